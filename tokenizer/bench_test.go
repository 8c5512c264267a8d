package tokenizer_test

import (
	"strings"
	"testing"
)

// longText joins the test strings into one text of about 1 MB: unicode,
// code, numbers and whitespace runs, with many repeated words.
func longText(b *testing.B) string {
	var s strings.Builder
	for _, c := range readCases(b) {
		s.WriteString(c.Text)
		s.WriteByte('\n')
	}
	return s.String()
}

// BenchmarkEncode reports encode throughput (MB/s) of a long text; the
// word cache is warm after the first iteration, as in a training run over
// a corpus.
func BenchmarkEncode(b *testing.B) {
	text := longText(b)
	for _, name := range []string{"gpt2-style.json", "llama3-style.json"} {
		tok := load(b, name)
		b.Run(strings.TrimSuffix(name, ".json"), func(b *testing.B) {
			b.SetBytes(int64(len(text)))
			for b.Loop() {
				if _, err := tok.Encode(text, false); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// BenchmarkEncodeCold is the same with a fresh tokenizer each time, so
// every word is merged from bytes.
func BenchmarkEncodeCold(b *testing.B) {
	text := longText(b)
	for _, name := range []string{"gpt2-style.json", "llama3-style.json"} {
		b.Run(strings.TrimSuffix(name, ".json"), func(b *testing.B) {
			b.SetBytes(int64(len(text)))
			for b.Loop() {
				b.StopTimer()
				tok := load(b, name)
				b.StartTimer()
				if _, err := tok.Encode(text, false); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}
