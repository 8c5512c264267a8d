package main

import (
	"bufio"
	"bytes"
	"context"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"syscall"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// TestMain runs the command itself when a test starts this binary as it
// (trainLM), so that a test can kill it.
func TestMain(m *testing.M) {
	if os.Getenv("TRAIN_LM_AS_COMMAND") == "1" {
		main()
		os.Exit(0)
	}
	os.Exit(m.Run())
}

var small = []string{"-device", "cpu", "-steps", "40", "-ckpt-every", "10", "-log-every", "5", "-seq", "32", "-warmup", "5"}

// trainLM runs the command with args; when killAt matches a line of its
// output it is killed with SIGKILL there. It returns the output.
func trainLM(t *testing.T, killAt *regexp.Regexp, args ...string) (string, bool) {
	t.Helper()
	cmd := exec.Command(os.Args[0], append(append([]string{}, small...), args...)...)
	cmd.Env = append(os.Environ(), "TRAIN_LM_AS_COMMAND=1")
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	pipe, err := cmd.StdoutPipe()
	require.NoError(t, err)
	require.NoError(t, cmd.Start())
	var out strings.Builder
	killed := false
	sc := bufio.NewScanner(pipe)
	for sc.Scan() {
		out.WriteString(sc.Text() + "\n")
		if killAt != nil && !killed && killAt.MatchString(sc.Text()) {
			require.NoError(t, cmd.Process.Signal(syscall.SIGKILL))
			killed = true
		}
	}
	err = cmd.Wait()
	if killed {
		ws, ok := cmd.ProcessState.Sys().(syscall.WaitStatus)
		require.True(t, ok && ws.Signaled() && ws.Signal() == syscall.SIGKILL, "killed: %v\n%s", err, out.String())
	} else {
		require.NoError(t, err, "%s\n%s", out.String(), stderr.String())
	}
	return out.String(), killed
}

// losses are the log lines' step and mean loss ("step 25/40  loss 2.1234").
var lossRe = regexp.MustCompile(`(?m)^step +\d+/\d+  loss \d+\.\d+`)

// A run killed with SIGKILL after its checkpoint of step 20 and resumed
// with -resume ends with the parameters of the run that was never
// interrupted, bit for bit (the SHA-256 of their float32 bits), and logs
// the same losses from step 20 on.
func TestResumeAfterKill9(t *testing.T) {
	straight, _ := trainLM(t, nil, "-dir", t.TempDir())
	digest := regexp.MustCompile(`(?m)^params sha256 [0-9a-f]{64}$`).FindString(straight)
	require.NotEmpty(t, digest, straight)
	assert.Len(t, lossRe.FindAllString(straight, -1), 8)
	assert.Regexp(t, `(?m)^checkpoint .*ckpt-00000040$`, straight)

	dir := t.TempDir()
	first, killed := trainLM(t, regexp.MustCompile(`^checkpoint .*ckpt-00000020$`), "-dir", dir)
	require.True(t, killed, first)
	assert.NotContains(t, first, "params sha256")
	resumed, _ := trainLM(t, nil, "-dir", dir, "-resume")
	assert.Contains(t, resumed, "resumed at step 20\n")
	assert.Contains(t, resumed, digest+"\n", "the final parameters, bit for bit")
	want := lossRe.FindAllString(straight, -1)
	assert.Equal(t, want[4:], lossRe.FindAllString(resumed, -1), "the losses from step 20 on")
	assert.Equal(t, want[:len(lossRe.FindAllString(first, -1))], lossRe.FindAllString(first, -1))

	// The corpus was generated once, and a run into a directory of
	// checkpoints needs -resume.
	assert.FileExists(t, filepath.Join(dir, "tokens.bin"))
	err := run(context.Background(), io.Discard, options{dir: dir, steps: 1, batch: 1, seq: 4, vocab: 64, layers: 1, heads: 1, dim: 4, ckptEvery: 1, logEvery: 1, device: "cpu", precision: "fp32"})
	assert.ErrorContains(t, err, "pass -resume")
	var out bytes.Buffer
	err = run(context.Background(), &out, options{data: filepath.Join(dir, "tokens.bin"), dir: t.TempDir(), steps: 2, batch: 2, seq: 8, vocab: 64,
		layers: 1, heads: 1, dim: 8, ckptEvery: 1, logEvery: 1, device: "cpu", precision: "fp32"})
	require.NoError(t, err, "-data: a token file of one's own")
	assert.Contains(t, out.String(), "tokens.bin: 65536 tokens, 8191 sequences of 8")
	err = run(context.Background(), &out, options{data: filepath.Join(dir, "tokens.bin"), dir: t.TempDir(), steps: 2, batch: 2, seq: 8, vocab: 16,
		layers: 1, heads: 1, dim: 8, ckptEvery: 1, logEvery: 1, device: "cpu", precision: "fp32"})
	require.Error(t, err, "tokens past -vocab")
}

func TestParseFlags(t *testing.T) {
	o, err := parseFlags(nil, io.Discard)
	require.NoError(t, err)
	assert.Equal(t, 200, o.steps)
	assert.Equal(t, "train-lm-out", o.dir)
	assert.False(t, o.resume)
	_, err = parseFlags([]string{"extra"}, io.Discard)
	assert.Error(t, err)
	for name, edit := range map[string]func(*options){
		"zero steps":   func(o *options) { o.steps = 0 },
		"one token":    func(o *options) { o.seq = 1 },
		"bad heads":    func(o *options) { o.heads = 3 },
		"no such mode": func(o *options) { o.precision = "bf17" },
	} {
		o, err := parseFlags([]string{"-dir", t.TempDir(), "-device", "cpu", "-steps", "1"}, io.Discard)
		require.NoError(t, err)
		edit(&o)
		assert.Error(t, run(context.Background(), io.Discard, o), name)
	}
}
