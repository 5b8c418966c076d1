// Active-message protocol (used where the lanes cannot do zero-copy RMA, e.g. tcp).
//
//   initiator                               owner (serves from its progress thread)
//   kAmPut [hdr: batch, part, segs] + data  -> validate segs against its arenas;
//                                              rendezvous: ucp_am_recv_data_nbx(iov of
//                                              its pages); eager: memcpy
//                                           <- kAmPutAck [batch, part, status]
//                                              (a batch of several messages: one ack,
//                                              part = num_parts, once all have landed)
//   kAmGetReq [hdr: batch, part, segs,      -> validate; reply with its pages as iov,
//              counts per message]             one kAmGetResp per message asked for
//   recv in place (rndv) or memcpy (eager)  <- kAmGetResp [batch, part, status] + data
//
// The owner never trusts the header: every segment is checked against a live arena,
// and a message of a batch answered once against the batch's record, before a byte
// moves. Callbacks never block: replies are non-blocking sends whose
// state (header, iov, arena references) lives in an OwnerOp until UCX completes it.
#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "internal.h"

namespace kvpool::transport {
namespace {

void OwnerSendCb(void* request, ucs_status_t status, void* user_data);
void OwnerRecvCb(void* request, ucs_status_t status, size_t length, void* user_data);

}  // namespace

struct OwnerOp {
  WorkerImpl* worker = nullptr;
  ucp_ep_h reply_ep = nullptr;
  AmHeader header{};
  std::vector<ucp_dt_iov_t> iov;
  std::vector<std::shared_ptr<Arena>> hold;
  bool refused = false;  // the reply carries a refusal
  std::string reason;    // a refusal's payload
};

namespace {

void OwnerSendCb(void* request, ucs_status_t status, void* user_data) {
  auto* op = static_cast<OwnerOp*>(user_data);
  WorkerImpl* w = op->worker;
  const bool served = status == UCS_OK && !op->refused;
  delete op;
  ucp_request_free(request);
  w->OwnerOpDone(served);
}

void OwnerRecvCb(void* request, ucs_status_t status, size_t /*length*/, void* user_data) {
  ucp_request_free(request);
  auto* op = static_cast<OwnerOp*>(user_data);
  op->worker->OwnerPutReceived(op, status);
}

void InitiatorRecvCb(void* request, ucs_status_t status, size_t /*length*/, void* user_data) {
  auto* b = static_cast<Batch*>(user_data);
  ucp_request_free(request);
  b->worker->OnOpDone(b, status);
}

void CopyIn(const std::vector<ucp_dt_iov_t>& iov, const void* data) {
  auto* src = static_cast<const std::byte*>(data);
  for (const auto& v : iov) {
    std::memcpy(v.buffer, src, v.length);
    src += v.length;
  }
}

}  // namespace

absl::Status WorkerImpl::ResolveOwnerSegments(const WireSeg* segs, uint32_t n, uint64_t total,
                                              std::vector<ucp_dt_iov_t>* iov,
                                              std::vector<std::shared_ptr<Arena>>* hold,
                                              std::optional<uint32_t>* bad_seg) {
  uint64_t sum = 0;
  iov->reserve(n);
  for (uint32_t i = 0; i < n; ++i) {
    if (bad_seg != nullptr) *bad_seg = i;  // cleared below once every segment passed
    WireSeg s;
    std::memcpy(&s, &segs[i], sizeof(s));
    std::shared_ptr<Arena> a;
    for (auto& h : *hold) {
      if (h->id() == s.arena_id) a = h;
    }
    if (!a) {
      a = FindArena(s.arena_id);
      if (!a) {
        return absl::InvalidArgumentError(
            absl::StrCat("arena ", s.arena_id, " is not served by this worker"));
      }
      hold->push_back(a);
    }
    if (s.len == 0 || s.offset > a->size() || s.len > a->size() - s.offset) {
      return absl::InvalidArgumentError(absl::StrCat("segment [", s.offset, ", +", s.len,
                                                     ") is outside arena ", s.arena_id));
    }
    iov->push_back({a->base() + s.offset, s.len});
    sum += s.len;
  }
  if (bad_seg != nullptr) bad_seg->reset();
  if (total != UINT64_MAX && sum != total) {
    return absl::InvalidArgumentError(
        absl::StrCat("segments cover ", sum, " bytes but the payload has ", total));
  }
  return absl::OkStatus();
}

void WorkerImpl::SendOwnerReply(ucp_ep_h reply_ep, unsigned id, uint64_t batch_id,
                                uint32_t part, absl::Status status,
                                std::vector<ucp_dt_iov_t> iov,
                                std::vector<std::shared_ptr<Arena>> hold,
                                std::optional<uint32_t> bad_seg) {
  auto* op = new OwnerOp();
  op->worker = this;
  op->header.batch_id = batch_id;
  op->header.part = part;
  op->header.status = static_cast<uint32_t>(status.code());
  op->refused = !status.ok();
  op->iov = std::move(iov);
  op->hold = std::move(hold);
  if (op->refused) {
    // The initiator names the reason and the op it refers to (kMaxRefusalBytes).
    op->header.num_segs = bad_seg ? *bad_seg + 1 : 0;
    op->reason = std::string(status.message().substr(0, kMaxRefusalBytes));
    op->iov.clear();
    if (!op->reason.empty()) op->iov.push_back({op->reason.data(), op->reason.size()});
  }
  ucp_request_param_t p{};
  p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  p.cb.send = &OwnerSendCb;
  p.user_data = op;
  // The initiator accepts a reply only from the endpoint its batch went out on
  // (param->reply_ep there): another peer cannot complete its batches.
  p.op_attr_mask |= UCP_OP_ATTR_FIELD_FLAGS;
  p.flags = UCP_AM_SEND_FLAG_REPLY;
  p.flags |= EagerFlagFor(op->iov);
  // UCX asserts on an empty iov: header-only replies are contig; so is a single piece
  // (zero-copy rendezvous on tcp, see WorkerImpl::StartAm).
  const void* payload = nullptr;
  size_t count = 0;
  if (op->iov.size() == 1) {
    payload = op->iov[0].buffer;
    count = op->iov[0].length;
  } else if (!op->iov.empty()) {
    p.op_attr_mask |= UCP_OP_ATTR_FIELD_DATATYPE;
    p.datatype = ucp_dt_make_iov();
    payload = op->iov.data();
    count = op->iov.size();
  }
  OwnerInflight(+1);
  ucs_status_ptr_t r = ucp_am_send_nbx(reply_ep, id, &op->header, sizeof(op->header), payload,
                                       count, &p);
  if (r == nullptr || UCS_PTR_IS_ERR(r)) {
    const bool served = r == nullptr && !op->refused;
    delete op;
    OwnerOpDone(served);
  }
}

void WorkerImpl::OwnerOpDone(bool ok) {
  OwnerInflight(-1);
  absl::MutexLock l(&mu_);
  ++(ok ? stats_.am_requests_served : stats_.am_requests_refused);
}

namespace {
// Statuses with which UCX fails a request because its endpoint failed or is being torn
// down: the reply endpoint may be gone (UCX releases a failed endpoint it created for a
// peer), and the initiator learns of the failure from its own endpoint.
bool EndpointFailed(ucs_status_t status) {
  switch (status) {
    case UCS_ERR_CONNECTION_RESET:
    case UCS_ERR_ENDPOINT_TIMEOUT:
    case UCS_ERR_CANCELED:
    case UCS_ERR_UNREACHABLE:
    case UCS_ERR_NOT_CONNECTED:
    case UCS_ERR_REJECTED:
    case UCS_ERR_IO_ERROR:  // what some transports report for a lost peer
      return true;
    default:
      return false;
  }
}
}  // namespace

void WorkerImpl::OwnerPutReceived(OwnerOp* op, ucs_status_t status) {
  std::unique_ptr<OwnerOp> owned(op);
  if (status != UCS_OK && EndpointFailed(status)) {
    // The initiator is gone (or its endpoint is): its endpoint fails the batch; a reply
    // could not be delivered and reply_ep may no longer be valid.
    if (op->header.num_parts > 1) {
      PutPartDone(op->reply_ep, op->header, FromUcs(status, "owner receiving the put"),
                  /*reply=*/false);
    }
    OwnerOpDone(false);
    return;
  }
  OwnerInflight(-1);  // the receive; the ack counts on its own
  if (op->header.num_parts > 1) {
    PutPartDone(op->reply_ep, op->header, FromUcs(status, "owner receiving the put"));
    return;
  }
  // Any other failure (no memory, a bad buffer, ...) leaves a live initiator waiting for
  // this ack: refuse the message rather than let its batch run into the deadline and its
  // endpoint be closed.
  SendOwnerReply(op->reply_ep, kAmPutAck, op->header.batch_id, op->header.part,
                 FromUcs(status, "owner receiving the put"), {}, {});
}

void WorkerImpl::PutPartDone(ucp_ep_h reply_ep, const AmHeader& h, const absl::Status& status,
                              bool reply, std::optional<uint32_t> bad_seg) {
  auto [it, fresh] = pending_puts_.try_emplace(std::make_pair(reply_ep, h.batch_id));
  PendingPut& pp = it->second;
  pp.last = MonotonicNow();
  // (size() counts this fresh record, which is no tombstone: the live records with it.)
  if (fresh && pending_puts_.size() - pending_put_tombstones_ > kMaxPendingPutRecords) {
    // Records are bounded too: refuse. The refused batch keeps a tombstone (no bits)
    // past the bound, up to kMaxPendingPutTombstones more: its later messages must find
    // it, or one arriving after other puts landed and made room would be written into
    // the arena after its initiator was told the put failed. Only past that second bound
    // is a batch refused without a record (its later messages are dropped while the owner
    // stays over the first, OnAm).
    if (reply) {
      SendOwnerReply(reply_ep, kAmPutAck, h.batch_id, h.part,
                     absl::ResourceExhaustedError(absl::StrCat("the owner tracks ", kMaxPendingPutRecords,
                                                               " puts under way (at most); retry once they landed")),
                     {}, {});
    }
    if (pending_puts_.size() > kMaxPendingPutRecords + kMaxPendingPutTombstones || h.num_parts <= 1) {
      pending_puts_.erase(it);
      return;
    }
    pp.parts = h.num_parts;
    pp.refused = true;
    pp.landed = 1;  // this message, dropped
    ++pending_put_tombstones_;
    return;
  }
  if (fresh) {
    pp.parts = h.num_parts;
    // Each record holds a bit per message of its batch, for up to kPendingPutTtl: bound
    // their sum, or header-only messages naming 2^20 parts each would grow the owner
    // by 128 KiB per 24-byte message. A batch past the bound is refused and kept as a
    // tombstone (no bits) that drops its later messages until they all came.
    if (pending_put_parts_ + h.num_parts > kMaxPendingPutParts) {
      pp.refused = true;
      if (reply) {
        SendOwnerReply(reply_ep, kAmPutAck, h.batch_id, h.part,
                       absl::ResourceExhaustedError(absl::StrCat(
                           "the owner tracks ", pending_put_parts_, " messages of puts under way (at most ",
                           kMaxPendingPutParts, "); retry once they landed")),
                       {}, {});
      }
      if (pending_puts_.size() > kMaxPendingPutRecords + kMaxPendingPutTombstones) {  // refused without a record
        pending_puts_.erase(it);
        return;
      }
      ++pending_put_tombstones_;
    } else {
      pp.seen.assign(h.num_parts, false);
      pending_put_parts_ += h.num_parts;
    }
  }
  if (pp.seen.empty()) {  // a tombstone: count the message, drop it
    if (++pp.landed >= pp.parts) {
      pending_puts_.erase(it);
      --pending_put_tombstones_;
    }
    return;
  }
  absl::Status st = status;
  if (st.ok() && (h.num_parts != pp.seen.size() || h.part >= pp.seen.size() || pp.seen[h.part])) {
    st = absl::InvalidArgumentError(absl::StrCat("message ", h.part, " of ", h.num_parts,
                                                 " does not fit its batch"));
  }
  if (h.part < pp.seen.size() && !pp.seen[h.part]) {
    pp.seen[h.part] = true;
    ++pp.landed;
  }
  if (!st.ok() && !pp.refused) {
    pp.refused = true;
    if (reply) SendOwnerReply(reply_ep, kAmPutAck, h.batch_id, h.part, st, {}, {}, bad_seg);
  }
  if (pp.landed < pp.seen.size()) return;
  if (!pp.refused) {
    SendOwnerReply(reply_ep, kAmPutAck, h.batch_id, static_cast<uint32_t>(pp.seen.size()),
                   absl::OkStatus(), {}, {});
  }
  pending_put_parts_ -= pp.seen.size();
  pending_puts_.erase(it);
}

void WorkerImpl::SweepPendingPuts() {
  const absl::Time now = MonotonicNow();
  if (now < next_pending_sweep_) return;
  next_pending_sweep_ = now + absl::Seconds(1);
  absl::erase_if(pending_puts_, [&](const auto& e) {
    if (now - e.second.last <= kPendingPutTtl) return false;
    pending_put_parts_ -= e.second.seen.size();
    pending_put_tombstones_ -= e.second.seen.empty();
    return true;
  });
}

void WorkerImpl::ServeGet(ucp_ep_h reply_ep, const AmHeader& h, const void* header,
                          size_t header_len) {
  const uint32_t parts = std::max(1u, h.num_parts);
  const char* at = static_cast<const char*>(header) + sizeof(AmHeader);
  std::vector<uint32_t> counts;
  absl::Status st;
  if (parts > kMaxSegsPerMsg || h.num_segs > kMaxSegsPerMsg ||
      header_len != sizeof(AmHeader) + uint64_t{h.num_segs} * sizeof(WireSeg) +
                        (h.num_parts > 0 ? uint64_t{parts} * sizeof(uint32_t) : 0)) {
    st = absl::InvalidArgumentError("malformed transfer header");
  } else if (h.num_parts == 0) {
    counts.push_back(h.num_segs);
  } else {
    counts.resize(parts);
    std::memcpy(counts.data(), at + uint64_t{h.num_segs} * sizeof(WireSeg), parts * sizeof(uint32_t));
    uint64_t sum = 0;
    for (uint32_t c : counts) sum += c;
    if (sum != h.num_segs || std::find(counts.begin(), counts.end(), 0u) != counts.end()) {
      st = absl::InvalidArgumentError("malformed transfer header: message segment counts");
    }
  }
  if (!st.ok()) {
    for (uint32_t i = 0; i < std::min(parts, kMaxSegsPerMsg); ++i) {
      SendOwnerReply(reply_ep, kAmGetResp, h.batch_id, h.part + i, st, {}, {});
    }
    return;
  }
  const auto* segs = reinterpret_cast<const WireSeg*>(at);
  for (uint32_t i = 0; i < parts; ++i) {
    std::vector<ucp_dt_iov_t> iov;
    std::vector<std::shared_ptr<Arena>> hold;
    std::optional<uint32_t> bad;
    absl::Status s = ResolveOwnerSegments(segs, counts[i], UINT64_MAX, &iov, &hold, &bad);
    if (!s.ok()) iov.clear();
    SendOwnerReply(reply_ep, kAmGetResp, h.batch_id, h.part + i, std::move(s), std::move(iov),
                   std::move(hold), bad);
    segs += counts[i];
  }
}

ucs_status_t WorkerImpl::OnAm(unsigned id, const void* header, size_t header_len, void* data,
                              size_t len, const ucp_am_recv_param_t* param) {
  const bool rndv = (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0;
  AmHeader h{};
  if (header_len < sizeof(AmHeader)) return rndv ? UCS_ERR_INVALID_PARAM : UCS_OK;
  std::memcpy(&h, header, sizeof(h));
  const bool has_reply = (param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP) != 0;
  if (id == kAmPutAck || id == kAmGetResp) {
    return OnInitiatorReply(id, h, data, len, rndv, has_reply ? param->reply_ep : nullptr);
  }

  // Owner side.
  if (!has_reply) return rndv ? UCS_ERR_INVALID_PARAM : UCS_OK;
  ucp_ep_h reply_ep = param->reply_ep;
  if (id == kAmGetReq) {
    ServeGet(reply_ep, h, header, header_len);
    return UCS_OK;
  }
  // kAmPut
  std::vector<ucp_dt_iov_t> iov;
  std::vector<std::shared_ptr<Arena>> hold;
  absl::Status st;
  std::optional<uint32_t> bad;
  if (header_len != sizeof(AmHeader) + uint64_t{h.num_segs} * sizeof(WireSeg)) {
    st = absl::InvalidArgumentError("malformed transfer header");
  } else {
    const auto* segs =
        reinterpret_cast<const WireSeg*>(static_cast<const char*>(header) + sizeof(AmHeader));
    st = ResolveOwnerSegments(segs, h.num_segs, len, &iov, &hold, &bad);
  }
  const bool one_reply = h.num_parts > 1;
  if (st.ok() && h.num_parts > kMaxPartsPerBatch) {
    st = absl::InvalidArgumentError(
        absl::StrCat("a batch of ", h.num_parts, " messages (at most ", kMaxPartsPerBatch, ")"));
  }
  if (!st.ok()) {
    if (one_reply && h.num_parts <= kMaxPartsPerBatch) {
      PutPartDone(reply_ep, h, st, /*reply=*/true, bad);
    } else {
      SendOwnerReply(reply_ep, kAmPutAck, h.batch_id, h.part, st, {}, {}, bad);
    }
    return rndv ? UCS_ERR_INVALID_PARAM : UCS_OK;
  }
  if (one_reply) {
    // A batch already refused (its initiator was told it failed), or one the owner will
    // refuse for want of room to track it (PutPartDone): the message is received and
    // dropped, not written into the arena.
    auto it = pending_puts_.find(std::make_pair(reply_ep, h.batch_id));
    const bool untrackable =
        it == pending_puts_.end() && (pending_put_parts_ + h.num_parts > kMaxPendingPutParts ||
                                      pending_puts_.size() - pending_put_tombstones_ >= kMaxPendingPutRecords);
    if (untrackable || (it != pending_puts_.end() && it->second.refused)) {
      PutPartDone(reply_ep, h, absl::OkStatus());
      return rndv ? UCS_ERR_INVALID_PARAM : UCS_OK;
    }
    // A message that does not fit its batch's record (another message count, a part out
    // of range or one that came already) is refused before its bytes move, not after.
    if (it != pending_puts_.end() && !it->second.seen.empty()) {
      const std::vector<bool>& seen = it->second.seen;
      if (h.num_parts != seen.size() || h.part >= seen.size() || seen[h.part]) {
        PutPartDone(reply_ep, h, absl::InvalidArgumentError(absl::StrCat("message ", h.part, " of ", h.num_parts,
                                                                         " does not fit its batch")));
        return rndv ? UCS_ERR_INVALID_PARAM : UCS_OK;
      }
    }
  }
  if (!rndv) {
    CopyIn(iov, data);
    if (one_reply) {
      PutPartDone(reply_ep, h, absl::OkStatus());
    } else {
      SendOwnerReply(reply_ep, kAmPutAck, h.batch_id, h.part, absl::OkStatus(), {}, {});
    }
    return UCS_OK;
  }
  auto* op = new OwnerOp();
  op->worker = this;
  op->reply_ep = reply_ep;
  op->header = h;
  op->iov = std::move(iov);
  op->hold = std::move(hold);
  ucp_request_param_t p{};
  p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  p.cb.recv_am = &OwnerRecvCb;
  p.user_data = op;
  OwnerInflight(+1);
  ucs_status_ptr_t r;
  if (op->iov.size() == 1) {  // contiguous: zero-copy rendezvous where UCX has one
    r = ucp_am_recv_data_nbx(worker_, data, op->iov[0].buffer, op->iov[0].length, &p);
  } else {
    p.op_attr_mask |= UCP_OP_ATTR_FIELD_DATATYPE;
    p.datatype = ucp_dt_make_iov();
    r = ucp_am_recv_data_nbx(worker_, data, op->iov.data(), op->iov.size(), &p);
  }
  if (r == nullptr) {
    OwnerPutReceived(op, UCS_OK);
  } else if (UCS_PTR_IS_ERR(r)) {
    OwnerPutReceived(op, UCS_PTR_STATUS(r));
  }
  return UCS_INPROGRESS;
}

namespace {
std::string RefusalMessage(const Batch& b, const AmHeader& h, const void* data, size_t len, bool rndv) {
  // The owner's reason (its payload; a rendezvous payload is not fetched: refusals are
  // small and eager) and the op it refers to, from the message's segments.
  const std::string reason = !rndv && data != nullptr && len > 0 && len <= kMaxRefusalBytes
                                 ? std::string(static_cast<const char*>(data), len)
                                 : "check the page descriptors";
  std::string where = absl::StrCat("message ", h.part);
  if (h.part < b.msg_first_seg.size() && h.part < b.iovs.size()) {
    const size_t first = b.msg_first_seg[h.part], n = b.iovs[h.part].size();
    if (h.num_segs > 0 && h.num_segs <= n && first + h.num_segs - 1 < b.segs.size()) {
      // Segments of consecutive ops merge when no observer needs them apart: "from".
      absl::StrAppend(&where, ", the segment from ops[", b.segs[first + h.num_segs - 1].op, "]");
    } else if (n > 0 && first + n - 1 < b.segs.size()) {
      const uint32_t lo = b.segs[first].op, hi = b.segs[first + n - 1].op;
      absl::StrAppend(&where, lo == hi ? absl::StrCat(", ops[", lo, "]") : absl::StrCat(", ops[", lo, "..", hi, "]"));
    }
  }
  return absl::StrCat("peer refused the transfer (", where, "): ", reason);
}
}  // namespace

ucs_status_t WorkerImpl::OnInitiatorReply(unsigned id, const AmHeader& h, void* data,
                                          size_t len, bool rndv, ucp_ep_h reply_ep) {
  auto it = batches_.find(h.batch_id);
  // No longer awaited (the batch is gone, or its endpoint failed): drop it.
  if (it == batches_.end() || it->second->replies_awaited <= 0) return UCS_OK;
  Batch& b = *it->second;
  // Batch ids are sequential, hence guessable: only the peer the batch went to may answer
  // it, once per message (a duplicate would count down another message's reply).
  if (reply_ep == nullptr || reply_ep != b.ep->ep_) return UCS_OK;
  // And only with the reply its direction expects: a get response to a put would land
  // the peer's bytes in the put's source pages, a put ack would end a get with nothing
  // landed.
  if (id != (b.dir == Direction::kPut ? kAmPutAck : kAmGetResp)) return UCS_OK;
  size_t slot = h.part;
  if (b.one_reply) {
    // One ack for the batch (part == its number of messages), or a refusal of one part.
    const bool whole = h.part == b.iovs.size() && h.status == 0;
    const bool refusal = h.part < b.iovs.size() && h.status != 0;
    if (id != kAmPutAck || !(whole || refusal)) return UCS_OK;
    slot = 0;
  }
  if (slot >= b.answered.size() || b.answered[slot]) return UCS_OK;
  b.answered[slot] = true;
  --b.replies_awaited;
  if (b.finished) {
    // A reply to a batch that already failed (another part refused, a timeout): it only
    // counts down, so the batch is released once nothing else is outstanding; a payload
    // is dropped (the caller may be reusing those pages).
    --b.outstanding;
    MaybeFree(b.id);
    return UCS_OK;
  }
  if (h.status != 0) {
    --b.outstanding;
    Finish(b, absl::Status(static_cast<absl::StatusCode>(h.status), RefusalMessage(b, h, data, len, rndv)));
    MaybeFree(b.id);
    return UCS_OK;
  }
  if (id == kAmPutAck) {
    OnOpDone(&b, UCS_OK);
    return UCS_OK;
  }
  // kAmGetResp: land the payload in the local pages of this part (h.part < iovs.size():
  // checked against `answered` above).
  const auto& iov = b.iovs[h.part];
  uint64_t want = 0;
  for (const auto& v : iov) want += v.length;
  if (want != len) {
    --b.outstanding;
    Finish(b, absl::DataLossError(
                  absl::StrCat("get response has ", len, " bytes, expected ", want)));
    MaybeFree(b.id);
    return UCS_OK;
  }
  if (!rndv) {
    CopyIn(iov, data);
    OnOpDone(&b, UCS_OK);
    return UCS_OK;
  }
  ucp_request_param_t p{};
  p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  p.cb.recv_am = &InitiatorRecvCb;
  p.user_data = &b;
  ucs_status_ptr_t r;
  if (iov.size() == 1) {  // contiguous: zero-copy rendezvous where UCX has one
    r = ucp_am_recv_data_nbx(worker_, data, iov[0].buffer, iov[0].length, &p);
  } else {
    p.op_attr_mask |= UCP_OP_ATTR_FIELD_DATATYPE;
    p.datatype = ucp_dt_make_iov();
    r = ucp_am_recv_data_nbx(worker_, data, const_cast<ucp_dt_iov_t*>(iov.data()), iov.size(),
                             &p);
  }
  if (r == nullptr) {
    OnOpDone(&b, UCS_OK);
  } else if (UCS_PTR_IS_ERR(r)) {
    OnOpDone(&b, UCS_PTR_STATUS(r));
  }
  // else: InitiatorRecvCb completes this part.
  return UCS_INPROGRESS;
}

}  // namespace kvpool::transport
