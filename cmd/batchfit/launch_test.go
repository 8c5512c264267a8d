package main

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"regexp"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/batchfit/batchfit/dist"
)

const launchHelperEnv = "BATCHFIT_LAUNCH_HELPER"

// TestLaunchHelper is the program the launch tests start: it does nothing
// unless BATCHFIT_LAUNCH_HELPER names a mode.
func TestLaunchHelper(t *testing.T) {
	mode := os.Getenv(launchHelperEnv)
	if mode == "" {
		t.Skip("the program launch tests start")
	}
	e, err := dist.EnvFromOS()
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(4)
	}
	switch mode {
	case "env":
		fmt.Printf("rank=%d local=%d world=%d addr=%s port-set=%v gpus=%s\n", e.Rank, e.LocalRank, e.WorldSize,
			e.MasterAddr, e.MasterPort > 0, os.Getenv("CUDA_VISIBLE_DEVICES"))
		fmt.Fprintf(os.Stderr, "to stderr\npartial line")
	case "rendezvous": // every rank gets rank 0's id over loopback TCP
		var id []byte
		if e.Rank == 0 {
			id = bytes.Repeat([]byte{42}, dist.IDSize)
		}
		got, err := dist.ExchangeID(context.Background(), e, id, time.Now().Add(30*time.Second))
		if err != nil {
			fmt.Println(err)
			os.Exit(5)
		}
		fmt.Printf("id %d\n", got[0])
	case "fail": // rank 1 fails at once; the others would sleep a minute
		if e.Rank == 1 {
			fmt.Println("failing")
			os.Exit(7)
		}
		time.Sleep(time.Minute)
	}
	os.Exit(0)
}

// launchHelper runs batchfit launch on this test binary in mode.
func launchHelper(t *testing.T, mode string, args ...string) (int, string, string, time.Duration) {
	t.Setenv(launchHelperEnv, mode)
	var out, errb bytes.Buffer
	start := time.Now()
	full := append([]string{"launch"}, args...)
	full = append(full, "--", os.Args[0], "-test.run=^TestLaunchHelper$", "-test.count=1")
	code := run(full, &out, &errb)
	return code, out.String(), errb.String(), time.Since(start)
}

func TestLaunchSetsTorchrunVariables(t *testing.T) {
	t.Setenv("CUDA_VISIBLE_DEVICES", "")
	os.Unsetenv("CUDA_VISIBLE_DEVICES")
	code, out, errs, _ := launchHelper(t, "env", "-n", "3")
	require.Equal(t, 0, code, "stdout:\n%s\nstderr:\n%s", out, errs)
	lines := strings.Split(strings.TrimSpace(out), "\n")
	sort.Strings(lines)
	require.Equal(t, []string{
		"[rank 0] rank=0 local=0 world=3 addr=127.0.0.1 port-set=true gpus=0",
		"[rank 1] rank=1 local=1 world=3 addr=127.0.0.1 port-set=true gpus=1",
		"[rank 2] rank=2 local=2 world=3 addr=127.0.0.1 port-set=true gpus=2",
	}, lines)
	for r := range 3 {
		assert.Contains(t, errs, fmt.Sprintf("[rank %d] to stderr\n", r))
		assert.Contains(t, errs, fmt.Sprintf("[rank %d] partial line\n", r))
	}
}

func TestLaunchVisibleDevicesList(t *testing.T) {
	t.Setenv("CUDA_VISIBLE_DEVICES", "5,6")
	code, out, errs, _ := launchHelper(t, "env", "-n", "2")
	require.Equal(t, 0, code, errs)
	assert.Contains(t, out, "[rank 0] rank=0 local=0 world=2 addr=127.0.0.1 port-set=true gpus=5\n")
	assert.Contains(t, out, "[rank 1] rank=1 local=1 world=2 addr=127.0.0.1 port-set=true gpus=6\n")
}

// Four launched processes meet at rank 0's rendezvous over loopback TCP.
func TestLaunchRendezvous(t *testing.T) {
	code, out, errs, _ := launchHelper(t, "rendezvous", "-n", "4")
	require.Equal(t, 0, code, "stdout:\n%s\nstderr:\n%s", out, errs)
	for r := range 4 {
		assert.Contains(t, out, fmt.Sprintf("[rank %d] id 42\n", r))
	}
}

// Rank 1 exits with 7: launch stops the sleeping ranks at once and exits
// with 7.
func TestLaunchFirstFailureStopsTheOthers(t *testing.T) {
	code, out, errs, took := launchHelper(t, "fail", "-n", "3", "--grace", "2s")
	require.Equal(t, 7, code, "stdout:\n%s\nstderr:\n%s", out, errs)
	assert.Less(t, took, 30*time.Second)
	assert.Contains(t, out, "[rank 1] failing\n")
	assert.Regexp(t, regexp.MustCompile(`rank 1 failed \(exit status 7, exit code 7\); stopping the others`), errs)
}

func TestLaunchUsage(t *testing.T) {
	for _, args := range [][]string{
		{"launch"},
		{"launch", "-n", "0", "--", "true"},
		{"launch", "-n", "2"},
		{"launch", "-n", "2", "--master-port", "70000", "--", "true"},
		{"launch", "--bogus"},
	} {
		var out, errb bytes.Buffer
		assert.Equal(t, exitUsage, run(args, &out, &errb), "%v", args)
		usageLines(t, "launch", errb.String())
	}
	var out, errb bytes.Buffer
	assert.Equal(t, exitOK, run([]string{"launch", "-h"}, &out, &errb))
	assert.Contains(t, out.String(), "LOCAL_RANK")
}
