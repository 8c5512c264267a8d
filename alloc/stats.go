package alloc

import "fmt"

// Stat is one counter as PyTorch keeps it: the current value, its peak since
// the last ResetPeak, and the running totals of increases and decreases.
type Stat struct {
	Current, Peak, Allocated, Freed int64
}

func (s *Stat) increase(n int64) {
	s.Current += n
	s.Allocated += n
	s.Peak = max(s.Peak, s.Current)
}

func (s *Stat) decrease(n int64) {
	s.Current -= n
	s.Freed += n
}

// Pool indexes the per-pool stat arrays: All aggregates both pools.
type Pool int

const (
	All Pool = iota
	SmallPool
	LargePool
	numPools
)

var poolNames = [numPools]string{"all", "small_pool", "large_pool"}

func (p Pool) String() string { return poolNames[p] }

// StatArray holds one stat per pool.
type StatArray [numPools]Stat

// Stats mirrors torch.cuda.memory_stats().
type Stats struct {
	Allocation         StatArray // live allocations (count)
	Segment            StatArray // reserved segments (count)
	Active             StatArray // allocated blocks (count)
	InactiveSplit      StatArray // free blocks inside split segments (count)
	AllocatedBytes     StatArray // bytes of live allocations, rounded
	ReservedBytes      StatArray // bytes of segments held from the device
	ActiveBytes        StatArray // bytes of allocated blocks
	InactiveSplitBytes StatArray // bytes of free blocks inside split segments
	RequestedBytes     StatArray // bytes asked for, before rounding
	NumAllocRetries    int64     // device allocations retried after releasing cache
	NumOOMs            int64     // allocations that failed for good
	NumDeviceAlloc     int64     // segments requested from the device
	NumDeviceFree      int64     // segments returned to the device
}

// update applies delta to the aggregate and to pool p's stat.
func (a *StatArray) update(p Pool, delta int64) {
	for _, q := range [2]Pool{All, p} {
		if delta >= 0 {
			a[q].increase(delta)
		} else {
			a[q].decrease(-delta)
		}
	}
}

func (a *StatArray) resetPeak() {
	for i := range a {
		a[i].Peak = a[i].Current
	}
}

// Map flattens the stats into PyTorch's key names, e.g.
// "allocated_bytes.all.peak", "num_alloc_retries".
func (s Stats) Map() map[string]int64 {
	m := map[string]int64{
		"num_alloc_retries": s.NumAllocRetries,
		"num_ooms":          s.NumOOMs,
		"num_device_alloc":  s.NumDeviceAlloc,
		"num_device_free":   s.NumDeviceFree,
	}
	for _, e := range s.arrays() {
		for p := All; p < numPools; p++ {
			st := e.a[p]
			for _, f := range []struct {
				k string
				v int64
			}{{"current", st.Current}, {"peak", st.Peak}, {"allocated", st.Allocated}, {"freed", st.Freed}} {
				m[fmt.Sprintf("%s.%s.%s", e.name, p, f.k)] = f.v
			}
		}
	}
	return m
}

func (s *Stats) arrays() []struct {
	name string
	a    *StatArray
} {
	return []struct {
		name string
		a    *StatArray
	}{
		{"allocation", &s.Allocation}, {"segment", &s.Segment}, {"active", &s.Active},
		{"inactive_split", &s.InactiveSplit}, {"allocated_bytes", &s.AllocatedBytes},
		{"reserved_bytes", &s.ReservedBytes}, {"active_bytes", &s.ActiveBytes},
		{"inactive_split_bytes", &s.InactiveSplitBytes}, {"requested_bytes", &s.RequestedBytes},
	}
}

func (s *Stats) resetPeak() {
	for _, e := range s.arrays() {
		e.a.resetPeak()
	}
}
