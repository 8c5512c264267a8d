// Package safetensors reads and writes the safetensors format: an 8-byte
// little-endian header length, a JSON header naming each tensor's dtype,
// shape and byte range, then the tensors' little-endian bytes.
//
// Files come from outside and are treated as hostile. Open refuses what is
// not a regular file (opened non-blocking, checked with fstat; symbolic
// links are followed, as Hugging Face's cache needs), a header longer
// than MaxHeaderBytes (100 MB, the reference implementation's bound) or
// than the file, a header that is not UTF-8 JSON, and any tensor whose
// dtype × shape is not its byte length, whose range leaves the data, or
// which overlaps or leaves a gap beside another (the tensors must tile the
// data exactly, as the reference requires). Errors wrap ErrFormat,
// ErrTooLarge, ErrNotRegular, ErrNotFound, ErrDType or ErrShape.
//
// Reads stream: File.ReadFloat32 reads a tensor straight into the caller's
// []float32 (F32 with no copy at all, BF16, F16 and F64 converted through
// a 256 KiB buffer), so an 8-billion-parameter checkpoint loads into its
// model's parameters without a second host copy. ReadFloat64, ReadInt64
// (I64, I32, I16, I8, U64, U32, U16, U8, BOOL) and ReadRaw read the other
// dtypes. Reads use pread and may run concurrently.
//
// WriteFile streams tensors (float32 values converted to F32, BF16, F16
// or F64 a chunk at a time, values produced on demand by a Fill function,
// or raw bytes) into a temporary file beside the target, syncs it and
// renames it into place. Its layout is the reference's byte for byte
// (tensors sorted by dtype then name, compact header padded to 8 bytes),
// so Python's safetensors and transformers load it.
//
// Why not a library: github.com/nlpodyssey/safetensors, the Go
// implementation on the module proxy, parses a whole file held in one
// []byte (the caller reads or maps it), converts no dtypes, returns
// untyped errors (fmt.Errorf strings, nothing errors.Is can test), and
// serializes from a map of byte views, which needs every converted tensor
// in memory at once and writes in place rather than atomically. The format
// is small; this package is the bounded streaming reader and writer
// batchfit needs.
package safetensors
