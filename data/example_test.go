package data_test

import (
	"context"
	"fmt"
	"os"
	"path/filepath"

	"gorgonia.org/tensor"

	"github.com/batchfit/batchfit/data"
)

// A token file in llm.c's format, mapped, cut into windows of 8 tokens
// and batched 2 at a time in a shuffled order; a second loader resumes
// from the first one's position and yields the batch that came next.
func Example() {
	dir, err := os.MkdirTemp("", "tokens")
	if err != nil {
		fmt.Println(err)
		return
	}
	defer os.RemoveAll(dir)
	ids := make([]uint16, 65) // 0, 1, …, 64: eight windows of 8 and their targets
	for i := range ids {
		ids[i] = uint16(i)
	}
	path := filepath.Join(dir, "train.bin")
	out, err := os.Create(path)
	if err != nil {
		fmt.Println(err)
		return
	}
	if err := data.WriteTokens(out, data.Tokens16(ids), data.FormatLLMC); err != nil {
		fmt.Println(err)
		return
	}
	out.Close()

	f, err := data.OpenTokens(path, data.FormatAuto)
	if err != nil {
		fmt.Println(err)
		return
	}
	defer f.Close()
	ds, err := data.NewWindows(f.Tokens, 8, data.WindowOptions{Vocab: 65})
	if err != nil {
		fmt.Println(err)
		return
	}
	opts := data.Options{Batch: 2, Shuffle: true, Seed: 42}
	l, err := data.NewLoader(ds, opts)
	if err != nil {
		fmt.Println(err)
		return
	}
	defer l.Close()
	ctx := context.Background()
	fmt.Println(f.Format, "file of", f.Len(), "tokens:", ds.Len(), "windows,", l.BatchesPerEpoch(), "batches an epoch")
	for range 2 {
		b, err := l.Next(ctx)
		if err != nil {
			fmt.Println(err)
			return
		}
		in, tg := b.Tensor("inputs"), b.Tensor("targets")
		fmt.Println("inputs", in.Shape(), "first row", row(in), "targets", row(tg))
	}

	opts.Start = l.Position() // what a checkpoint stores
	resumed, err := data.NewLoader(ds, opts)
	if err != nil {
		fmt.Println(err)
		return
	}
	defer resumed.Close()
	next, _ := l.Next(ctx)
	again, _ := resumed.Next(ctx)
	fmt.Println("next batch starts", row(next.Tensor("inputs"))[0], "and after resuming", row(again.Tensor("inputs"))[0])
	// Output:
	// llm.c file of 65 tokens: 8 windows, 4 batches an epoch
	// inputs (2, 8) first row [8 9 10 11 12 13 14 15] targets [9 10 11 12 13 14 15 16]
	// inputs (2, 8) first row [48 49 50 51 52 53 54 55] targets [49 50 51 52 53 54 55 56]
	// next batch starts 16 and after resuming 16
}

// row is the first row of a [batch, seq] int64 tensor.
func row(t *tensor.Dense) []int64 {
	seq := t.Shape()[1]
	return t.Data().([]int64)[:seq]
}
