package main

import "time"

// stepLoop is one timed training loop (the executor's, throughput; the
// Session's, sessionThroughput): its record, its step and what ends it.
type stepLoop struct {
	r     *Record
	step  func(i int) error // step i of the warm-up and timed steps, counted from 0
	end   func() error      // after the last step: the record's totals and rates
	close func()            // releases the loop's executor or session
}

// A step's time runs from its start to its return, which is the next
// step's start: Execute and Session.Step return before the step's last
// kernels end, and the next step's host work and launches queue behind
// them (cuda.Executor.Execute), so a step's time is its share of the
// loop's, not a synchronised step's.

// runLoop runs l's c.warmup untimed and c.steps timed steps.
func runLoop(l *stepLoop, c config) error {
	if err := warmUp(l, c.warmup); err != nil {
		return err
	}
	if _, err := timedBlock(l, c.warmup, c.steps); err != nil {
		return err
	}
	return l.end()
}

// runInterleaved runs a's warm-up, then b's, then their timed steps in
// alternate blocks of k (a first), so that both see the same device and
// host, block by block: a device's clocks and a host's load drift over
// seconds, by as much as the difference measured. Each pair of blocks
// gives the ratio of b's median step to a's; b's record keeps their
// median (OverPaired).
func runInterleaved(a, b *stepLoop, c config, k int) error {
	for _, l := range []*stepLoop{a, b} {
		if err := warmUp(l, c.warmup); err != nil {
			return err
		}
	}
	var ratios []float64
	for done := 0; done < c.steps; done += k {
		n := min(k, c.steps-done)
		ma, err := timedBlock(a, c.warmup+done, n)
		if err != nil {
			return err
		}
		mb, err := timedBlock(b, c.warmup+done, n)
		if err != nil {
			return err
		}
		ratios = append(ratios, mb/ma)
	}
	b.r.OverPaired, b.r.Interleave = median(ratios), k
	a.r.Interleave = k
	if err := a.end(); err != nil {
		return err
	}
	return b.end()
}

// warmUp runs l's first n steps, untimed.
func warmUp(l *stepLoop, n int) error {
	for i := range n {
		if err := l.step(i); err != nil {
			return err
		}
	}
	return nil
}

// timedBlock runs l's steps from to from+n−1, appending each one's time
// to its record, and returns their median.
func timedBlock(l *stepLoop, from, n int) (float64, error) {
	times := make([]float64, 0, n)
	prev := time.Now()
	for i := from; i < from+n; i++ {
		if err := l.step(i); err != nil {
			return 0, err
		}
		now := time.Now()
		times = append(times, now.Sub(prev).Seconds())
		prev = now
	}
	l.r.StepSeconds = append(l.r.StepSeconds, times...)
	return median(times), nil
}
