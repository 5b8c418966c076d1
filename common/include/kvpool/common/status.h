// Status helpers shared by every kvpool library.
//
// kvpool uses absl::Status / absl::StatusOr<T> across every boundary; codes follow
// absl's (== gRPC's) meaning for the caller:
//   INVALID_ARGUMENT    the input is wrong: fix it, do not retry as is
//   NOT_FOUND           the named thing does not exist
//   RESOURCE_EXHAUSTED  out of blocks / pages / capacity: retry later or free some
//   FAILED_PRECONDITION the system is not in a state for this: don't retry until fixed
//   UNAVAILABLE         transient (peer down, not started): retry the call
//   DATA_LOSS           bytes failed their checksum: the copy was dropped
//
// The installed abseil (20220623) predates ABSL_RETURN_IF_ERROR, hence this pair.
//
// Example:
//   absl::StatusOr<int> Parse(absl::string_view s);
//   absl::Status Use(absl::string_view s) {
//     ASSIGN_OR_RETURN(int v, Parse(s));
//     RETURN_IF_ERROR(Check(v));
//     return absl::OkStatus();
//   }
#pragma once

#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#define KVPOOL_STATUS_CONCAT_INNER_(a, b) a##b
#define KVPOOL_STATUS_CONCAT_(a, b) KVPOOL_STATUS_CONCAT_INNER_(a, b)

// Evaluates `expr` (an absl::Status) and returns it from the enclosing function if it
// is not OK.
#ifndef RETURN_IF_ERROR
#define RETURN_IF_ERROR(expr)                                      \
  do {                                                             \
    ::absl::Status kvpool_status_ = (expr);                        \
    if (!kvpool_status_.ok()) return kvpool_status_;               \
  } while (0)
#endif

// Evaluates `rexpr` (an absl::StatusOr<T>); on error returns its status, otherwise
// moves the value into `lhs`, which may be a declaration (`auto x`, `int x`).
#ifndef ASSIGN_OR_RETURN
#define ASSIGN_OR_RETURN(lhs, rexpr) \
  KVPOOL_ASSIGN_OR_RETURN_IMPL_(KVPOOL_STATUS_CONCAT_(kvpool_statusor_, __LINE__), lhs, rexpr)
#endif

#define KVPOOL_ASSIGN_OR_RETURN_IMPL_(statusor, lhs, rexpr) \
  auto statusor = (rexpr);                                  \
  if (!statusor.ok()) return std::move(statusor).status();  \
  lhs = std::move(statusor).value()
