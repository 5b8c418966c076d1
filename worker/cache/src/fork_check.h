// The child-id check both cache managers run before a Fork changes anything.
#pragma once

#include <span>

#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "kvpool/worker/cache/cache_manager.h"

namespace kvpool::cache {

// ALREADY_EXISTS when a child id is the parent's, is in use (`in_use(id)`), or repeats in
// `children` (a repeated id would reserve twice and keep one reservation for good).
template <typename InUse>
absl::Status CheckForkChildren(RequestId parent, std::span<const RequestId> children, InUse in_use) {
  absl::flat_hash_set<RequestId> seen;
  for (RequestId c : children) {
    if (c == parent || in_use(c) || !seen.insert(c).second) {
      return absl::AlreadyExistsError(absl::StrCat("fork of request ", parent, ": child id ", c,
                                                   " is already in use (or repeated); pick fresh ids"));
    }
  }
  return absl::OkStatus();
}

}  // namespace kvpool::cache
