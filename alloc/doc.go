// Package alloc is batchfit's caching device allocator. It follows the
// rules of PyTorch's CUDA caching allocator, so memory figures read the way
// PyTorch users expect, and it runs unchanged over any Backend: the CUDA
// driver when executing, a simulated device when planning. Prediction and
// execution therefore share one allocator and get the same peaks, segment
// splits and rounding included.
//
// The rules (sizes in bytes):
//   - Requests round up to a multiple of 512 (minimum 512).
//   - Rounded sizes ≤ 1 MiB are small and are carved from 2 MiB segments;
//     larger ones come from the large pool, whose new segments are 20 MiB
//     for requests below 10 MiB and the request rounded up to 2 MiB above.
//   - A request takes the best-fitting cached free block of its pool: the
//     smallest that is large enough, lowest address first.
//   - A block is split when the remainder is ≥ 512 (small pool) or
//     > 1 MiB (large pool); the request keeps the lower addresses.
//   - A freed block merges with free neighbours of its segment.
//   - When the device refuses a new segment, every cached segment that is
//     whole (not split) is released and the device asked once more
//     (num_alloc_retries); if that fails too, Malloc returns an *OOMError
//     (num_ooms).
//
// Stats use PyTorch's memory_stats keys ("allocated_bytes.all.peak", …).
// An optional trace records alloc, free, segment_alloc, segment_free and
// oom events tagged with the node, op and module path that caused them.
// An Allocator is safe for concurrent use.
package alloc
