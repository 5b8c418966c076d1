#include "kvpool/router/router_host.h"

#include <optional>

#include "absl/strings/str_cat.h"
#include "kvpool/common/clock.h"
#include "kvpool/common/status.h"

namespace kvpool::router {

absl::StatusOr<std::unique_ptr<RouterHost>> RouterHost::Create(RouterHostOptions options,
                                                              MetricsRegistry* metrics, Clock clock) {
  if (options.max_streams == 0 || options.apply_slice_events == 0) {
    return absl::InvalidArgumentError("max_streams and apply_slice_events must be > 0");
  }
  ASSIGN_OR_RETURN(auto core, RouterCore::Create(options.core));
  auto host = std::unique_ptr<RouterHost>(new RouterHost(std::move(options), metrics, std::move(clock)));
  host->core_ = std::move(core);
  if (metrics != nullptr) {
    for (int k = 0; k < kNumPolicies; ++k) {
      host->decisions_[k] = &metrics->GetCounter("kvpool_router_decisions_total", "Routing decisions by policy",
                                                 {{"policy", std::string(PolicyName(static_cast<PolicyKind>(k)))}});
    }
    host->hit_gpu_ = &metrics->GetCounter("kvpool_router_predicted_hit_blocks_total",
                                          "Prefix blocks predicted reusable at the chosen instance",
                                          {{"tier", "gpu"}});
    host->hit_pool_ = &metrics->GetCounter("kvpool_router_predicted_hit_blocks_total",
                                           "Prefix blocks predicted reusable at the chosen instance",
                                           {{"tier", "pool"}});
    host->requested_blocks_ =
        &metrics->GetCounter("kvpool_router_requested_blocks_total", "Full blocks in routed requests");
    host->route_errors_ = &metrics->GetCounter("kvpool_router_route_errors_total", "Route calls that failed");
    host->events_applied_ = &metrics->GetCounter("kvpool_router_events_applied_total", "KV events applied");
    host->dropped_sources_ =
        &metrics->GetCounter("kvpool_router_dropped_sources_total", "Sources dropped for missed heartbeats");
    host->event_lag_ = &metrics->GetHistogram("kvpool_router_event_lag_seconds",
                                              "Time from receiving an event batch to applying it",
                                              Histogram::ExponentialBounds(1e-5, 4, 10));
    host->route_latency_ = &metrics->GetHistogram("kvpool_router_route_core_seconds",
                                                  "Time Route spends in the core (lock wait included)",
                                                  Histogram::ExponentialBounds(1e-6, 4, 10));
    host->queued_batches_ = &metrics->GetGauge("kvpool_router_queued_event_batches", "Event batches waiting");
    RouterHost* h = host.get();
    host->scrape_hook_ = metrics->AddScrapeHook([h] { h->RefreshGauges(); });
  }
  host->applier_ = std::thread([h = host.get()] { h->ApplierLoop(); });
  return host;
}

RouterHost::RouterHost(RouterHostOptions options, MetricsRegistry* metrics, Clock clock)
    : options_(std::move(options)),
      metrics_(metrics),
      clock_(clock ? std::move(clock) : Clock([] { return MonotonicNow(); })) {}

RouterHost::~RouterHost() {
  // The registry may outlive this host: its hook must not run on a host that is gone.
  if (metrics_ != nullptr && scrape_hook_ != 0) metrics_->RemoveScrapeHook(scrape_hook_);
  {
    absl::MutexLock l(&queue_mu_);
    stop_ = true;
  }
  if (applier_.joinable()) applier_.join();
  std::deque<Work> left;
  {
    absl::MutexLock l(&queue_mu_);
    left.swap(queue_);
  }
  for (Work& w : left) w.done(absl::UnavailableError("router is shutting down; reconnect and resend"));
}

void RouterHost::RefreshGauges() {
  const RouterStatsSnapshot s = Stats();
  metrics_->GetGauge("kvpool_router_index_entries", "(hash, holder) pairs in the index")
      .Set(static_cast<double>(s.index_entries));
  metrics_->GetGauge("kvpool_router_index_bytes", "Memory the index uses").Set(static_cast<double>(s.index_bytes));
  metrics_->GetGauge("kvpool_router_index_bytes_per_entry", "Index bytes per (hash, holder) pair")
      .Set(s.index_entries > 0 ? static_cast<double>(s.index_bytes) / static_cast<double>(s.index_entries) : 0);
  metrics_->GetGauge("kvpool_router_index_pruned_entries", "Entries pruned to respect --max-index-entries")
      .Set(static_cast<double>(s.pruned_entries));
  size_t workers = 0, stale = 0;
  for (const SourceStats& x : s.sources) {
    workers += x.kind == SourceKind::kWorker;
    stale += x.stale;
  }
  metrics_->GetGauge("kvpool_router_sources", "Registered sources", {{"kind", "worker"}})
      .Set(static_cast<double>(workers));
  metrics_->GetGauge("kvpool_router_sources", "Registered sources", {{"kind", "pool_node"}})
      .Set(static_cast<double>(s.sources.size() - workers));
  metrics_->GetGauge("kvpool_router_stale_sources", "Sources waiting for a full dump").Set(static_cast<double>(stale));
}

absl::StatusOr<RouteDecision> RouterHost::Route(const RouteInput& in) {
  const absl::Time start = clock_();
  absl::StatusOr<RouteDecision> d;
  {
    absl::MutexLock l(&core_mu_);
    d = core_->Route(in, start);
  }
  if (metrics_ != nullptr) {
    route_latency_->Observe(absl::ToDoubleSeconds(clock_() - start));
    if (d.ok()) {
      decisions_[static_cast<int>(d->policy)]->Increment();
      hit_gpu_->Increment(d->gpu_hit_blocks);
      hit_pool_->Increment(d->pool_hit_blocks);
      requested_blocks_->Increment(d->total_blocks);
    } else {
      route_errors_->Increment();
    }
  }
  return d;
}

absl::StatusOr<uint64_t> RouterHost::Register(const SourceInfo& info) {
  const absl::Time now = clock_();
  absl::MutexLock l(&core_mu_);
  RETURN_IF_ERROR(core_->Register(info, now));
  ASSIGN_OR_RETURN(const RouterCore::Registration reg, core_->FindRegistration(info.id));
  return reg.id;
}

absl::Status RouterHost::Unregister(absl::string_view source_id, uint64_t registration) {
  absl::MutexLock l(&core_mu_);
  if (registration != 0) {
    absl::StatusOr<RouterCore::Registration> reg = core_->FindRegistration(source_id);
    if (reg.ok() && reg->id != registration) {
      return absl::NotFoundError(absl::StrCat("source_id=\"", source_id.substr(0, 64), "\" registration ",
                                              registration, " is not current (", reg->id,
                                              " is): the source registered again since; nothing dropped"));
    }
  }
  return core_->Deregister(source_id);
}

HeartbeatResult RouterHost::Heartbeat(absl::string_view source_id, const InstanceLoad& load,
                                      std::span<const uint64_t> completed) {
  const absl::Time now = clock_();
  absl::MutexLock l(&core_mu_);
  return core_->Heartbeat(source_id, load, completed, now);
}

RouterStatsSnapshot RouterHost::Stats() {
  const absl::Time now = clock_();
  absl::MutexLock l(&core_mu_);
  return core_->Stats(now);
}

absl::Status RouterHost::OpenStream() {
  absl::MutexLock l(&queue_mu_);
  if (stop_) return absl::UnavailableError("router is shutting down");
  if (streams_ >= options_.max_streams) {
    return absl::ResourceExhaustedError(absl::StrCat("router already has ", streams_,
                                                     " event streams open (max_streams); retry later"));
  }
  ++streams_;
  return absl::OkStatus();
}

void RouterHost::CloseStream() {
  absl::MutexLock l(&queue_mu_);
  --streams_;
}

uint64_t RouterHost::RegistrationOf(absl::string_view source_id) {
  absl::MutexLock l(&core_mu_);
  const auto reg = core_->FindRegistration(source_id);
  return reg.ok() ? reg->id : 0;
}

void RouterHost::StreamLost(absl::string_view source_id, uint64_t registration) {
  absl::MutexLock l(&core_mu_);
  core_->StreamLost(source_id, registration);
}

void RouterHost::Enqueue(std::string source_id, uint64_t registration, EventBatch batch, Done done) {
  {
    absl::MutexLock l(&queue_mu_);
    if (!stop_) {
      queue_.push_back(Work{std::move(source_id), registration, std::move(batch), std::move(done), clock_()});
      if (queued_batches_ != nullptr) queued_batches_->Set(static_cast<double>(queue_.size()));
      return;
    }
  }
  done(absl::UnavailableError("router is shutting down; reconnect and resend"));
}

absl::StatusOr<RouterCore::Registration> RouterHost::CheckRegistration(const Work& w) {
  ASSIGN_OR_RETURN(const RouterCore::Registration reg, core_->FindRegistration(w.source_id));
  if (w.registration == 0) {
    return absl::NotFoundError(absl::StrCat("source_id=\"", w.source_id, "\" was not registered when this stream ",
                                            "began; call Register first, then open the stream"));
  }
  if (w.registration > reg.id) {  // ids only grow: never this source's
    return absl::InvalidArgumentError(absl::StrCat("registration=", w.registration, " is not one source_id=\"",
                                                   w.source_id, "\" was given (its current one is ", reg.id,
                                                   "); send the RegisterResponse.registration of its latest Register"));
  }
  if (reg.id != w.registration) {
    // Either this source registered again since, or the stream named an older id that was
    // never its own (ids are global): the router keeps no history to tell them apart.
    return absl::AbortedError(absl::StrCat("source_id=\"", w.source_id, "\" registered again after this stream ",
                                           "began (registration=", w.registration, " is not its current one, ",
                                           reg.id, "); its events are dropped: publish on a stream opened after the ",
                                           "latest Register, starting with a full dump"));
  }
  RETURN_IF_ERROR(RouterCore::CheckPublishes(w.source_id, reg));
  return reg;
}

absl::StatusOr<EventsResult> RouterHost::Apply(Work& w, uint64_t* applied) {
  *applied = 0;
  const EventBatch& b = w.batch;
  const size_t n = b.events.size();
  const size_t slice = options_.apply_slice_events;
  // A slice also ends once its events carry apply_slice_hashes hashes (one event may
  // carry up to 4096): 256 events of 4096 hashes were ~1M index operations in one hold.
  // A `cleared` event carries none but scans the whole index: it weighs a full slice.
  const size_t slice_hashes = std::max<size_t>(1, options_.apply_slice_hashes);
  auto weight = [&](size_t i) {
    return b.events[i].type == KvEvent::Type::kCleared ? slice_hashes : b.events[i].hashes.size();
  };
  auto slice_end = [&](size_t from) {  // at least one event, when there is one
    if (from >= n) return n;
    size_t end = from + 1, hashes = weight(from);
    while (end < n && end - from < slice && hashes + weight(end) <= slice_hashes) {
      hashes += weight(end);
      ++end;
    }
    return end;
  };
  if (!b.full_dump && slice_end(0) == n) {
    const absl::Time now = clock_();
    absl::MutexLock l(&core_mu_);
    RETURN_IF_ERROR(CheckRegistration(w).status());
    absl::StatusOr<EventsResult> r = core_->ApplyEvents(w.source_id, b, now);
    if (r.ok()) *applied = r->apply.applied;
    return r;
  }
  // Validate everything first, so a bad event late in the batch applies nothing. Off the
  // lock: the checks need only the source's kind, and it cannot change under this
  // registration, which every slice checks. So the slices are not validated again under
  // the lock (ApplyPart): that would only repeat this answer while Route waits.
  SourceKind kind;
  {
    absl::MutexLock l(&core_mu_);
    ASSIGN_OR_RETURN(const RouterCore::Registration reg, CheckRegistration(w));
    kind = reg.kind;
  }
  RETURN_IF_ERROR(RouterCore::ValidateEvents(w.source_id, kind, b.events));
  // A full dump applies in parts too (its first part drops the source's entries, its
  // last sets the sequence). The batch's slices run back to back on this thread, so no
  // other batch of the source lands between them; Route sees the dump applied so far.
  EventsResult total;
  size_t i = 0;
  do {
    const size_t end = slice_end(i);
    const absl::Time now = clock_();
    absl::MutexLock l(&core_mu_);
    RETURN_IF_ERROR(CheckRegistration(w).status());
    absl::StatusOr<EventsResult> r = core_->ApplyPart(w.source_id, b, i, end, now);
    RETURN_IF_ERROR(r.status());
    total.apply.applied += r->apply.applied;
    *applied = total.apply.applied;
    total.apply.duplicates += r->apply.duplicates;
    total.apply.ignored += r->apply.ignored;
    total.apply.gap |= r->apply.gap;
    total.apply.last_sequence = r->apply.last_sequence;
    total.full_dump_requested = r->full_dump_requested;
    total.apply.full_dump_requested = r->full_dump_requested;
    i = end;
  } while (i < n);
  return total;
}

void RouterHost::ApplierLoop() {
  absl::Time next_tick = clock_() + options_.tick_interval;
  for (;;) {
    std::optional<Work> w;
    {
      absl::MutexLock l(&queue_mu_);
      auto ready = [this]() ABSL_SHARED_LOCKS_REQUIRED(queue_mu_) { return stop_ || !queue_.empty(); };
      queue_mu_.AwaitWithTimeout(absl::Condition(&ready), options_.tick_interval);
      if (stop_) return;
      if (!queue_.empty()) {
        w.emplace(std::move(queue_.front()));
        queue_.pop_front();
        if (queued_batches_ != nullptr) queued_batches_->Set(static_cast<double>(queue_.size()));
      }
    }
    if (w) {
      uint64_t applied = 0;
      absl::StatusOr<EventsResult> r = Apply(*w, &applied);
      if (metrics_ != nullptr) {
        event_lag_->Observe(absl::ToDoubleSeconds(clock_() - w->enqueued));
        // Slices that landed before a later one failed count too, as in the core's stats.
        events_applied_->Increment(static_cast<double>(applied));
      }
      w->done(std::move(r));
    }
    if (clock_() >= next_tick) {
      std::vector<std::string> dropped;
      {
        const absl::Time now = clock_();
        absl::MutexLock l(&core_mu_);
        dropped = core_->Tick(now);
      }
      if (dropped_sources_ != nullptr) dropped_sources_->Increment(static_cast<double>(dropped.size()));
      next_tick = clock_() + options_.tick_interval;
    }
  }
}

}  // namespace kvpool::router
