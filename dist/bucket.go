package dist

import (
	"context"
	"fmt"
)

// DefaultBucketBytes is the gradient bytes reduced per all-reduce call,
// PyTorch DDP's bucket_cap_mb of 25 MiB.
const DefaultBucketBytes = 25 << 20

// Buckets groups tensors of the given element counts into all-reduce
// buckets of at most capBytes of float32 each, in reverse order (the last
// parameter first, the order backward produces gradients in), as DDP does.
// A tensor larger than capBytes gets a bucket of its own. Each bucket lists
// indices into sizes, in the order they are packed.
func Buckets(sizes []int, capBytes int64) [][]int {
	if capBytes <= 0 {
		capBytes = DefaultBucketBytes
	}
	var (
		out   [][]int
		cur   []int
		bytes int64
	)
	for i := len(sizes) - 1; i >= 0; i-- {
		b := int64(sizes[i]) * 4
		if len(cur) > 0 && bytes+b > capBytes {
			out = append(out, cur)
			cur, bytes = nil, 0
		}
		cur = append(cur, i)
		bytes += b
	}
	if len(cur) > 0 {
		out = append(out, cur)
	}
	return out
}

// reduceBuckets multiplies every buffer by scale and replaces it by the
// sum over ranks, one AllReduceSum per bucket (packed into one flat
// buffer). With scale 1 nothing is multiplied.
func reduceBuckets(ctx context.Context, c Communicator, bufs [][]float32, scale float32, capBytes int64) error {
	return forBuckets(bufs, capBytes, func(flat []float32) error {
		if scale != 1 {
			for i := range flat {
				flat[i] *= scale
			}
		}
		return c.AllReduceSum(ctx, flat)
	})
}

// broadcastBuckets replaces every buffer by root's, bucket by bucket.
func broadcastBuckets(ctx context.Context, c Communicator, bufs [][]float32, root int, capBytes int64) error {
	return forBuckets(bufs, capBytes, func(flat []float32) error { return c.Broadcast(ctx, flat, root) })
}

// forBuckets packs each bucket of bufs into one flat buffer, runs fn on
// it and unpacks the result. A bucket of one buffer runs in place.
func forBuckets(bufs [][]float32, capBytes int64, fn func([]float32) error) error {
	sizes := make([]int, len(bufs))
	for i, b := range bufs {
		sizes[i] = len(b)
	}
	var flat []float32
	for _, bk := range Buckets(sizes, capBytes) {
		if len(bk) == 1 {
			if err := fn(bufs[bk[0]]); err != nil {
				return err
			}
			continue
		}
		n := 0
		for _, i := range bk {
			n += len(bufs[i])
		}
		if cap(flat) < n {
			flat = make([]float32, n)
		}
		flat = flat[:n]
		off := 0
		for _, i := range bk {
			off += copy(flat[off:], bufs[i])
		}
		if err := fn(flat); err != nil {
			return err
		}
		off = 0
		for _, i := range bk {
			off += copy(bufs[i], flat[off:])
		}
		if off != n {
			return fmt.Errorf("dist: bucket unpacked %d of %d values", off, n)
		}
	}
	return nil
}
