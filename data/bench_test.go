package data_test

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"testing"

	"github.com/batchfit/batchfit/data"
)

// benchTokens is the token file the loader benchmarks read: 64 Mi GPT-2
// tokens (128 MiB) in llm.c's format, written once per run. It sits in
// the page cache after writing, so the benchmarks measure the loader
// (mapping, windows, widening to int64, batching, the ring), not the disk.
func benchTokens(b *testing.B) string {
	b.Helper()
	path := filepath.Join(b.TempDir(), "train.bin")
	toks := narrow(randomTokens(9, 64<<20, 50257))
	must(b, os.WriteFile(path, llmcFile(20240520, 1, int32(len(toks)), toks), 0o644))
	return path
}

func must(b *testing.B, err error) {
	b.Helper()
	if err != nil {
		b.Fatal(err)
	}
}

// BenchmarkLoaderTokens is the loader's throughput over a memory-mapped
// token file: shuffled windows of seq tokens, batch samples each, int64
// inputs and targets, through Next. MB/s counts the file's bytes read
// (2 per token, seq+1 tokens a sample); tokens/s the tokens delivered
// (batch·seq a batch); out-GB/s the int64 tensors written (two per token).
// The target is 5 GB/s of file bytes.
func BenchmarkLoaderTokens(b *testing.B) {
	path := benchTokens(b)
	f, err := data.OpenTokens(path, data.FormatAuto)
	must(b, err)
	defer f.Close()
	for _, c := range []struct{ batch, seq, workers int }{
		{8, 1024, 1}, {64, 1024, 1}, {64, 1024, 4}, {64, 1024, runtime.GOMAXPROCS(0)}, {512, 1024, runtime.GOMAXPROCS(0)},
	} {
		b.Run(fmt.Sprintf("batch=%d/seq=%d/workers=%d", c.batch, c.seq, c.workers), func(b *testing.B) {
			w, err := data.NewWindows(f.Tokens, c.seq, data.WindowOptions{Vocab: 50257})
			must(b, err)
			l, err := data.NewLoader(w, data.Options{Batch: c.batch, Shuffle: true, Seed: 1, Workers: c.workers, Prefetch: 4})
			must(b, err)
			defer l.Close()
			ctx := context.Background()
			b.SetBytes(int64(c.batch * (c.seq + 1) * 2))
			b.ResetTimer()
			for range b.N {
				if _, err := l.Next(ctx); err != nil {
					b.Fatal(err)
				}
			}
			s := b.Elapsed().Seconds()
			b.ReportMetric(float64(b.N*c.batch*c.seq)/s, "tokens/s")
			b.ReportMetric(float64(b.N*c.batch*c.seq*16)/s/1e9, "out-GB/s")
		})
	}
}
