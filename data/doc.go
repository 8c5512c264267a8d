// Package data feeds training steps: datasets of fixed-size samples,
// token streams memory-mapped from the .bin files nanoGPT and llm.c
// write, and a Loader that batches them, shuffles each epoch from a seed,
// fills batches ahead in a goroutine and resumes exactly where a
// checkpoint left it.
//
//	f, err := data.OpenTokens("train.bin", data.FormatAuto) // llm.c's header, or nanoGPT's raw uint16
//	ds, err := data.NewWindows(f.Tokens, 1024, data.WindowOptions{Vocab: 50257})
//	l, err := data.NewLoader(ds, data.Options{Batch: 8, Shuffle: true, Seed: 1, Host: sess.HostMemory()})
//	for step := range steps {
//		b, err := l.Next(ctx)
//		x := lazy.Wrap(b.Tensor("inputs"), 0)
//		loss := models.Loss(model.Forward(x), x.Graph().Wrap(b.Tensor("targets"), 0))
//		_, err = sess.Step(ctx, loss, params, opt)
//		… save l.Position() with the checkpoint …
//	}
//
// The rules:
//
//   - A batch is a pure function of (seed, epoch, index): the order of an
//     epoch is a keyed permutation (order.go), so prefetching, the number
//     of workers and their timing never change which samples a batch
//     holds, and Options.Start = Loader.Position() continues the
//     identical sequence.
//   - A batch's tensors live in the loader's storage until the next call
//     to Next: a Session's Step has read its inputs when it returns. With
//     Options.Host (batchfit.Session.HostMemory on CUDA) that storage is
//     page-locked, and the executor uploads it by DMA with no staging
//     copy, while the loader fills the next batches.
//   - Files are hostile: OpenTokens opens without blocking, takes regular
//     files only, checks the size against the header, and reads the
//     mapping so that a file truncated under it is ErrChanged, not a
//     crash. WindowOptions.Vocab bounds every token an embedding will
//     index. Errors are typed (errors.Is: ErrFormat, ErrSize,
//     ErrNotRegular, ErrToken, ErrPosition, ErrOptions, ErrClosed).
//   - Text reaches a token stream through an Encoder (EncodeTexts), the
//     seam a tokenizer plugs into; WriteTokens saves the stream in either
//     file format.
//
// Memory maps come from golang.org/x/sys/unix (the Go team's, with the
// rest of the unix system calls); elsewhere the file is read into memory.
package data
