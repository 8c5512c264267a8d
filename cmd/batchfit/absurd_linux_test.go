package main

import (
	"bytes"
	"encoding/json"
	"os"
	"os/exec"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// cliEnv makes the test binary run the command it holds and exit, so that a
// test can measure one command's time and peak memory in a process of its
// own.
const cliEnv = "BATCHFIT_TEST_CLI"

// runChild runs the command args in a child process and returns its exit
// code, output, wall time and peak resident memory.
func runChild(t *testing.T, args ...string) (code int, stdout, stderr string, wall time.Duration, maxRSS int64) {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^TestAbsurdBatch$")
	cmd.Env = append(os.Environ(), cliEnv+"="+strings.Join(args, "\x1f"))
	var o, e bytes.Buffer
	cmd.Stdout, cmd.Stderr = &o, &e
	start := time.Now()
	err := cmd.Run()
	wall = time.Since(start)
	if err != nil {
		var ee *exec.ExitError
		require.ErrorAs(t, err, &ee)
	}
	ru, ok := cmd.ProcessState.SysUsage().(*syscall.Rusage)
	require.True(t, ok)
	return cmd.ProcessState.ExitCode(), o.String(), e.String(), wall, ru.Maxrss << 10 // Maxrss is in KiB on Linux
}

// A batch of 10⁹ plans in bounded memory and time: the plan describes its
// chunks instead of listing them, and the replays skip repeating chunks a
// run at a time. A batch whose tensors cannot exist is a clean error.
func TestAbsurdBatch(t *testing.T) {
	if args := os.Getenv(cliEnv); args != "" {
		tuneGC() // as main does
		os.Exit(run(strings.Split(args, "\x1f"), os.Stdout, os.Stderr))
	}
	const bound = 256 << 20
	for _, model := range []string{"mlp", "convnet"} {
		code, stdout, stderr, wall, rss := runChild(t, "estimate", "--model", model, "--batch", "1000000000",
			"--budget", "24GiB", "--table", "--top", "3", "--json")
		t.Logf("%s at batch 10⁹: exit %d in %v, peak RSS %d MiB", model, code, wall, rss>>20)
		require.Equal(t, exitOK, code, "%s", stderr)
		assert.Less(t, wall, 30*time.Second)
		assert.Less(t, rss, int64(bound), "peak resident memory")
		var r struct { // the fields this test reads, so that it runs against any version of the report
			Steps int `json:"program_steps"`
			Plan  *struct {
				NumChunks    int   `json:"num_chunks"`
				PeakReserved int64 `json:"peak_reserved"`
				Chunks       []struct{ Count, Size int }
			}
			Timeline []json.RawMessage
		}
		require.NoError(t, json.Unmarshal([]byte(stdout), &r))
		require.NotNil(t, r.Plan)
		total := 0
		for _, run := range r.Plan.Chunks {
			total += run.Count * run.Size
		}
		assert.Equal(t, 1000000000, total, "the chunks cover the batch")
		assert.LessOrEqual(t, len(r.Plan.Chunks), 2)
		assert.Greater(t, r.Plan.NumChunks, 1)
		assert.LessOrEqual(t, r.Plan.PeakReserved, int64(24<<30))
		assert.NotEmpty(t, r.Timeline)
		assert.Less(t, len(r.Timeline), r.Steps, "the table shows one chunk")
		assert.Positive(t, r.Plan.PeakReserved)
	}

	// Beyond the graph's size limit the model does not build: exit 1, one
	// line.
	code, stdout, stderr, _, _ := runChild(t, "estimate", "--model", "mlp", "--batch", "9223372036854775807", "--budget", "24GiB")
	assert.Equal(t, exitPlan, code)
	assert.Empty(t, stdout)
	assert.Equal(t, 1, strings.Count(stderr, "\n"), "%s", stderr)
	assert.True(t, strings.HasPrefix(stderr, "batchfit estimate: building mlp: "), "%s", stderr)
}
