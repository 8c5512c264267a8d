package checkpoint

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"math"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// straightRun trains cfg from step 0 to the end without a checkpoint.
func straightRun(t *testing.T, cfg config) *run {
	t.Helper()
	r, err := newRun(cfg, 1)
	require.NoError(t, err)
	require.NoError(t, r.start())
	require.NoError(t, r.train(context.Background(), "", 0, totalSteps, 0, nil))
	return r
}

// A run saved at step 6, loaded by a new process's objects (other initial
// values, a new optimizer, session and loader) and trained on gives every
// loss and every parameter bit for bit as the uninterrupted run: fp32,
// bf16-mixed and fp16-mixed with its scaler, whole and in chunks of 4.
// Loading into the run's own objects after it went on (a rollback to an
// older checkpoint) gives the same.
func TestResumeBitIdentical(t *testing.T) {
	ctx := context.Background()
	for _, cfg := range configs {
		t.Run(cfg.String(), func(t *testing.T) {
			straight := straightRun(t, cfg)
			defer straight.close()
			lastBias := straight.model.Params()[len(straight.model.Params())-1].Value()
			biasSteps := straight.opt.ParamStep(lastBias)
			require.Less(t, biasSteps, straight.opt.Steps(), "the last bias joined at step 2")
			stats := straight.sess.LossScale()
			if cfg.precision == "fp16-mixed" {
				require.Positive(t, stats.Skipped, "the scaler skipped steps")
				require.Less(t, stats.Skipped, totalSteps-4, "and most steps ran")
			}

			dir := t.TempDir()
			first, err := newRun(cfg, 1)
			require.NoError(t, err)
			defer first.close()
			require.NoError(t, first.start())
			require.NoError(t, first.train(ctx, dir, 0, 7, 3, nil)) // saves after steps 3, 6 and 7
			for s := range 7 {
				require.Equal(t, math.Float32bits(straight.losses[s]), math.Float32bits(first.losses[s]), "step %d", s)
			}

			resumed, err := newRun(cfg, 99)
			require.NoError(t, err)
			defer resumed.close()
			require.NotEqual(t, straight.digest(), resumed.digest(), "other initial values")
			require.NoError(t, resumed.ck.Load(filepath.Join(dir, checkpointName(6, 0))))
			require.Equal(t, 6, resumed.ck.Step)
			require.NoError(t, resumed.start())
			require.NoError(t, resumed.train(ctx, "", resumed.ck.Step, totalSteps, 0, nil))
			for s := 6; s < totalSteps; s++ {
				require.Equal(t, math.Float32bits(straight.losses[s]), math.Float32bits(resumed.losses[s]), "step %d", s)
			}
			require.Equal(t, straight.digest(), resumed.digest(), "final parameters")
			require.Equal(t, biasSteps, resumed.opt.ParamStep(resumed.model.Params()[5].Value()))
			require.Equal(t, stats, resumed.sess.LossScale())

			// Back to step 6 in the first run's own session, optimizer and
			// model, which went on to step 7 meanwhile.
			require.NoError(t, first.ck.Load(filepath.Join(dir, checkpointName(6, 0))))
			first.loader.Close()
			require.NoError(t, first.start())
			require.NoError(t, first.train(ctx, "", 6, totalSteps, 0, nil))
			require.Equal(t, straight.digest(), first.digest(), "rolled back and trained on")
		})
	}
}

// The helper process: trains one configuration into a directory,
// resuming from its latest checkpoint when there is one, printing each
// step's loss bits, and pausing where the test asks so that it can be
// killed there.
func TestResumeHelperProcess(t *testing.T) {
	spec := os.Getenv("CHECKPOINT_HELPER")
	if spec == "" {
		t.Skip("run by TestResumeAfterSIGKILL")
	}
	if err := helper(spec); err != nil {
		fmt.Println("error", err)
		os.Exit(3)
	}
	os.Exit(0)
}

// helper runs spec: "precision chunk dir pause", pause "-" (none),
// "after:N" (stop after step N), or "PHASE@N" (stop in the save of step
// N at testHook's PHASE); dir "-" trains without checkpoints.
func helper(spec string) error {
	f := strings.Fields(spec)
	if len(f) != 4 {
		return fmt.Errorf("bad spec %q", spec)
	}
	chunk, err := strconv.Atoi(f[1])
	if err != nil {
		return err
	}
	cfg, dir, pause := config{precision: f[0], maxChunk: chunk}, f[2], f[3]
	if dir == "-" {
		dir = ""
	}
	hang := func() { fmt.Println("paused"); time.Sleep(time.Hour) }
	var afterStep = -1
	if n, ok := strings.CutPrefix(pause, "after:"); ok {
		if afterStep, err = strconv.Atoi(n); err != nil {
			return err
		}
	}
	seed := uint64(1)
	if dir != "" {
		if _, err := Latest(dir); err == nil {
			seed = 99 // a resumed run's initial values are the checkpoint's
		}
	}
	r, err := newRun(cfg, seed)
	if err != nil {
		return err
	}
	if phase, at, ok := strings.Cut(pause, "@"); ok {
		testHook = func(p string) {
			if p == phase && strconv.Itoa(r.ck.Step) == at {
				hang()
			}
		}
	}
	if dir != "" {
		if err := r.ck.Load(dir); err != nil && !errors.Is(err, ErrNoCheckpoint) {
			return err
		}
	}
	fmt.Println("start", r.ck.Step)
	if err := r.start(); err != nil {
		return err
	}
	err = r.train(context.Background(), dir, r.ck.Step, totalSteps, 3, func(s int) {
		fmt.Println("loss", s, math.Float32bits(r.losses[s]))
		if s == afterStep {
			hang()
		}
	})
	if err != nil {
		return err
	}
	fmt.Println("final", r.digest())
	fmt.Printf("scale %+v\n", r.sess.LossScale())
	return nil
}

// outcome is what a helper printed.
type outcome struct {
	start  int
	losses map[int]string
	final  string
	scale  string
	killed bool
}

// helperRun runs the helper on spec and kills it with SIGKILL when it
// pauses.
func helperRun(t *testing.T, spec string) outcome {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^TestResumeHelperProcess$", "-test.count=1")
	cmd.Env = append(os.Environ(), "CHECKPOINT_HELPER="+spec)
	out, err := cmd.StdoutPipe()
	require.NoError(t, err)
	cmd.Stderr = os.Stderr
	require.NoError(t, cmd.Start())
	o := outcome{start: -1, losses: map[int]string{}}
	sc := bufio.NewScanner(out)
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		switch {
		case len(f) == 1 && f[0] == "paused":
			require.NoError(t, cmd.Process.Signal(syscall.SIGKILL))
			o.killed = true
		case len(f) == 2 && f[0] == "start":
			o.start, _ = strconv.Atoi(f[1])
		case len(f) == 3 && f[0] == "loss":
			s, _ := strconv.Atoi(f[1])
			o.losses[s] = f[2]
		case len(f) == 2 && f[0] == "final":
			o.final = f[1]
		case f != nil && f[0] == "scale":
			o.scale = sc.Text()
		case f != nil && f[0] == "error":
			t.Errorf("helper %q: %s", spec, sc.Text())
		}
	}
	err = cmd.Wait()
	if o.killed {
		var ee *exec.ExitError
		require.ErrorAs(t, err, &ee, "helper %q", spec)
		ws, ok := ee.Sys().(syscall.WaitStatus)
		require.True(t, ok && ws.Signaled() && ws.Signal() == syscall.SIGKILL, "helper %q: %v", spec, err)
	} else {
		require.NoError(t, err, "helper %q", spec)
	}
	return o
}

// A training process killed with SIGKILL between steps, or in the middle
// of a save (its files written but no manifest; or the checkpoint renamed
// into place but the latest pointer not yet replaced), resumes from the
// last complete checkpoint, and every loss of both processes and the
// final parameters are bit for bit the uninterrupted run's. Saves run
// every 3 steps.
func TestResumeAfterSIGKILL(t *testing.T) {
	if testing.Short() {
		t.Skip("starts training processes")
	}
	cases := []struct {
		cfg    config
		pause  string
		resume int // the step the second process resumes at
	}{
		{config{precision: "fp32", maxChunk: 0}, "after:7", 6},
		{config{precision: "fp32", maxChunk: 4}, "after:4", 3},
		{config{precision: "bf16-mixed", maxChunk: 0}, "after:7", 6},
		{config{precision: "bf16-mixed", maxChunk: 4}, "after:10", 9},
		{config{precision: "fp16-mixed", maxChunk: 0}, "after:7", 6},
		{config{precision: "fp16-mixed", maxChunk: 4}, "after:7", 6},
		{config{precision: "fp32", maxChunk: 0}, "written@6", 3},
		{config{precision: "fp16-mixed", maxChunk: 4}, "written@9", 6},
		{config{precision: "bf16-mixed", maxChunk: 4}, "committed@6", 3},
		{config{precision: "fp16-mixed", maxChunk: 0}, "committed@9", 6},
	}
	straight := map[config]outcome{}
	for _, c := range cases {
		t.Run(c.cfg.String()+"/"+c.pause, func(t *testing.T) {
			s, ok := straight[c.cfg]
			if !ok {
				s = helperRun(t, fmt.Sprintf("%s %d - -", c.cfg.precision, c.cfg.maxChunk))
				require.Len(t, s.losses, totalSteps)
				straight[c.cfg] = s
			}
			dir := t.TempDir()
			spec := func(pause string) string {
				return fmt.Sprintf("%s %d %s %s", c.cfg.precision, c.cfg.maxChunk, dir, pause)
			}
			killed := helperRun(t, spec(c.pause))
			require.True(t, killed.killed, "the first process was killed")
			require.Equal(t, 0, killed.start)
			if phase, _, ok := strings.Cut(c.pause, "@"); ok {
				debris, err := filepath.Glob(filepath.Join(dir, ".ckpt-*.tmp-*"))
				require.NoError(t, err)
				require.Equal(t, phase == "written", len(debris) == 1, "the interrupted save's temporary directory: %v", debris)
			}
			m, err := Verify(dir)
			require.NoError(t, err, "the latest checkpoint is complete")
			require.Equal(t, c.resume, m.Step)

			resumed := helperRun(t, spec("-"))
			require.False(t, resumed.killed)
			require.Equal(t, c.resume, resumed.start)
			for _, o := range []outcome{killed, resumed} {
				for step, bits := range o.losses {
					assert.Equal(t, s.losses[step], bits, "step %d's loss", step)
				}
			}
			require.Len(t, killed.losses, maxStep(killed.losses)+1, "steps 0… in order")
			require.Len(t, resumed.losses, totalSteps-c.resume)
			require.Equal(t, s.final, resumed.final, "final parameters")
			require.Equal(t, s.scale, resumed.scale, "loss scale")
			debris, err := filepath.Glob(filepath.Join(dir, ".*.tmp-*"))
			require.NoError(t, err)
			require.Empty(t, debris, "the next saves cleared the debris")
			m, err = Verify(dir)
			require.NoError(t, err)
			require.Equal(t, totalSteps, m.Step)
		})
	}
}

func maxStep(l map[int]string) int {
	top := -1
	for s := range l {
		top = max(top, s)
	}
	return top
}
