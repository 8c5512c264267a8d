package main

import (
	"bytes"
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"os/signal"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"
)

const launchUsage = `Usage:
  batchfit launch -n N [--master-addr ADDR] [--master-port PORT] [--grace DURATION] -- PROGRAM [ARGS...]

Starts N processes of PROGRAM on this machine with torchrun's variables set,
for data-parallel training (package dist):
  RANK, LOCAL_RANK     0 … N−1 (one node: the same)
  WORLD_SIZE, LOCAL_WORLD_SIZE   N
  MASTER_ADDR          --master-addr (127.0.0.1)
  MASTER_PORT          --master-port, or a free loopback port
  CUDA_VISIBLE_DEVICES the rank's GPU: LOCAL_RANK when unset, the
                       LOCAL_RANK-th entry when set to a list of N or more,
                       left as it is otherwise
Every line a rank writes is forwarded with a "[rank R] " prefix, to stdout or
stderr as it wrote it. When a rank fails, the others get SIGTERM (SIGKILL
after --grace) and launch exits with the first failure's code (128+signal
for a rank killed by a signal); 0 when every rank succeeds.
`

// launchConfig is a parsed launch command line.
type launchConfig struct {
	n          int
	addr       string
	port       int
	grace      time.Duration
	program    []string
	visibleEnv string // CUDA_VISIBLE_DEVICES of the launcher; "-" when unset
}

// launchFlags defines launch's flags on c.
func launchFlags(c *launchConfig) *flag.FlagSet {
	fs := flag.NewFlagSet("launch", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	fs.IntVar(&c.n, "n", 0, "number of processes")
	fs.StringVar(&c.addr, "master-addr", "127.0.0.1", "address rank 0 serves the rendezvous on")
	fs.IntVar(&c.port, "master-port", 0, "port of the rendezvous (0: a free one)")
	fs.DurationVar(&c.grace, "grace", 5*time.Second, "time between SIGTERM and SIGKILL for the other ranks after a failure")
	return fs
}

func parseLaunch(args []string) (launchConfig, error) {
	c := launchConfig{}
	fs := launchFlags(&c)
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return c, err
		}
		return c, usagef(errFlag, "%v", err)
	}
	c.program = fs.Args()
	switch {
	case c.n < 1:
		return c, usagef(errRange, "-n must be at least 1")
	case len(c.program) == 0:
		return c, usagef(errMissing, "missing program (batchfit launch -n N -- PROGRAM ARGS...)")
	case c.port < 0 || c.port > 65535:
		return c, usagef(errRange, "--master-port %d is not a port", c.port)
	case c.grace < 0:
		return c, usagef(errRange, "--grace must not be negative")
	}
	return c, nil
}

func runLaunch(args []string, stdout, stderr io.Writer) int {
	c, err := parseLaunch(args)
	if errors.Is(err, flag.ErrHelp) {
		fmt.Fprint(stdout, launchUsage)
		return exitOK
	}
	if err != nil {
		return usageFailed(stderr, "launch", err)
	}
	if c.port == 0 {
		if c.port, err = freePort(c.addr); err != nil {
			fmt.Fprintf(stderr, "batchfit launch: no free port on %s: %v\n", c.addr, err)
			return exitPlan
		}
	}
	c.visibleEnv = "-"
	if v, ok := os.LookupEnv("CUDA_VISIBLE_DEVICES"); ok {
		c.visibleEnv = v
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	return launch(ctx, c, os.Environ(), stdout, stderr)
}

// freePort is a port free on addr a moment ago.
func freePort(addr string) (int, error) {
	ln, err := net.Listen("tcp", net.JoinHostPort(addr, "0"))
	if err != nil {
		return 0, err
	}
	defer ln.Close()
	return ln.Addr().(*net.TCPAddr).Port, nil
}

// rankEnv is base with the rank's variables set (replacing any there).
func rankEnv(base []string, c launchConfig, rank int) []string {
	set := map[string]string{
		"RANK": strconv.Itoa(rank), "LOCAL_RANK": strconv.Itoa(rank), "GROUP_RANK": "0",
		"WORLD_SIZE": strconv.Itoa(c.n), "LOCAL_WORLD_SIZE": strconv.Itoa(c.n),
		"MASTER_ADDR": c.addr, "MASTER_PORT": strconv.Itoa(c.port),
	}
	switch list := strings.Split(c.visibleEnv, ","); {
	case c.visibleEnv == "-":
		set["CUDA_VISIBLE_DEVICES"] = strconv.Itoa(rank)
	case len(list) >= c.n:
		set["CUDA_VISIBLE_DEVICES"] = strings.TrimSpace(list[rank])
	}
	env := make([]string, 0, len(base)+len(set))
	for _, kv := range base {
		if k, _, _ := strings.Cut(kv, "="); set[k] == "" {
			env = append(env, kv)
		}
	}
	for _, k := range []string{"RANK", "LOCAL_RANK", "GROUP_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "CUDA_VISIBLE_DEVICES"} {
		if v, ok := set[k]; ok {
			env = append(env, k+"="+v)
		}
	}
	return env
}

// lineWriter forwards whole lines to w, each with prefix, under a lock
// that every rank's writers share, so lines of ranks never interleave. A
// last line without a newline is written by flush.
type lineWriter struct {
	mu     *sync.Mutex
	w      io.Writer
	prefix string
	buf    []byte
}

func (l *lineWriter) Write(p []byte) (int, error) {
	l.buf = append(l.buf, p...)
	for {
		i := bytes.IndexByte(l.buf, '\n')
		if i < 0 {
			break
		}
		l.emit(l.buf[:i])
		l.buf = l.buf[i+1:]
	}
	if len(l.buf) > 1<<20 { // a very long line goes out in pieces
		l.flush()
	}
	return len(p), nil
}

func (l *lineWriter) emit(line []byte) {
	l.mu.Lock()
	defer l.mu.Unlock()
	fmt.Fprintf(l.w, "%s%s\n", l.prefix, line)
}

func (l *lineWriter) flush() {
	if len(l.buf) > 0 {
		l.emit(l.buf)
		l.buf = l.buf[:0]
	}
}

// exitCode is a finished rank's code: 128+signal for a signal.
func exitCode(err error) int {
	var ee *exec.ExitError
	if !errors.As(err, &ee) {
		return exitPlan
	}
	if ws, ok := ee.Sys().(syscall.WaitStatus); ok && ws.Signaled() {
		return 128 + int(ws.Signal())
	}
	if c := ee.ExitCode(); c > 0 {
		return c
	}
	return exitPlan
}

// launch runs the ranks and returns the first failure's exit code, or 0.
func launch(ctx context.Context, c launchConfig, base []string, stdout, stderr io.Writer) int {
	var mu sync.Mutex
	note := func(format string, args ...any) {
		mu.Lock()
		defer mu.Unlock()
		fmt.Fprintf(stderr, "batchfit launch: "+format+"\n", args...)
	}
	type result struct {
		rank int
		err  error
	}
	var cmds []*exec.Cmd
	waits := make(chan result, c.n)
	code := exitOK
	for r := range c.n {
		prefix := fmt.Sprintf("[rank %d] ", r)
		so, se := &lineWriter{mu: &mu, w: stdout, prefix: prefix}, &lineWriter{mu: &mu, w: stderr, prefix: prefix}
		cmd := exec.Command(c.program[0], c.program[1:]...)
		cmd.Env = rankEnv(base, c, r)
		cmd.Stdout, cmd.Stderr = so, se
		cmd.WaitDelay = c.grace // a grandchild holding the output open does not hold launch
		if err := cmd.Start(); err != nil {
			note("rank %d: %v", r, err)
			code = exitPlan
			break
		}
		cmds = append(cmds, cmd)
		go func() {
			err := cmd.Wait()
			so.flush()
			se.flush()
			waits <- result{r, err}
		}()
	}
	var once sync.Once
	kill := func() {
		once.Do(func() {
			for _, cmd := range cmds {
				_ = cmd.Process.Signal(syscall.SIGTERM) // an error says it has exited already
			}
			time.AfterFunc(c.grace, func() {
				for _, cmd := range cmds {
					_ = cmd.Process.Kill()
				}
			})
		})
	}
	if code != exitOK {
		kill()
	}
	for range cmds {
		var r result
		select {
		case r = <-waits:
		case <-ctx.Done():
			if code == exitOK {
				code = 130
				note("interrupted; stopping every rank")
			}
			kill()
			r = <-waits
		}
		if r.err != nil && code == exitOK {
			code = exitCode(r.err)
			note("rank %d failed (%v, exit code %d); stopping the others", r.rank, r.err, code)
			kill()
		}
	}
	return code
}
