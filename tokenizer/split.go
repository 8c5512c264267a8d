package tokenizer

import (
	"unicode"
	"unicode/utf8"
)

// The pre-tokenizer regexes of byte-level BPE tokenizers use a lookahead,
// \s+(?!\S), which Go's regexp lacks, so each known pattern is matched by
// hand here, alternative by alternative, with the leftmost-first
// backtracking semantics of the Oniguruma engine Hugging Face's tokenizers
// use. \s is Unicode White_Space (unicode.IsSpace), \p{L} and \p{N} the
// Unicode letter and number categories.
const (
	// gpt2Pattern is GPT-2's, which the ByteLevel pre-tokenizer applies
	// when use_regex is set.
	gpt2Pattern = `'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+`
	// llama3Pattern is Llama 3's (tiktoken's cl100k), used by a Split
	// pre-tokenizer before ByteLevel.
	llama3Pattern = `(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+`
	// qwen2Pattern is Llama 3's with single digits.
	qwen2Pattern = `(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+`
)

// A splitter cuts a piece of text into consecutive, non-empty pieces that
// cover it (every position of these patterns matches some alternative).
type splitter func(s string, emit func(string))

// knownSplitters maps a pattern to its hand-written matcher.
var knownSplitters = map[string]splitter{
	gpt2Pattern:   splitGPT2,
	llama3Pattern: func(s string, emit func(string)) { splitLlama3(s, 3, emit) },
	qwen2Pattern:  func(s string, emit func(string)) { splitLlama3(s, 1, emit) },
}

// class is a rune's class in these patterns.
type class uint8

const (
	classOther class = iota // [^\s\p{L}\p{N}]
	classLetter
	classNumber
	classSpace
)

var asciiClass = func() (t [utf8.RuneSelf]class) {
	for r := range rune(utf8.RuneSelf) {
		t[r] = slowClass(r)
	}
	return t
}()

func slowClass(r rune) class {
	switch {
	case unicode.IsLetter(r):
		return classLetter
	case unicode.IsNumber(r):
		return classNumber
	case unicode.IsSpace(r):
		return classSpace
	}
	return classOther
}

// at decodes the rune at byte i (valid UTF-8) and its class.
func at(s string, i int) (rune, int, class) {
	if c := s[i]; c < utf8.RuneSelf {
		return rune(c), 1, asciiClass[c]
	}
	r, w := utf8.DecodeRuneInString(s[i:])
	return r, w, slowClass(r)
}

// runOf is the end of the run of class c starting at i.
func runOf(s string, i int, c class) int {
	for i < len(s) {
		_, w, k := at(s, i)
		if k != c {
			break
		}
		i += w
	}
	return i
}

// contraction is the length of the contraction 's, 't, 're, 've, 'm, 'll
// or 'd at s[i] (an apostrophe), 0 if none. Case-insensitive matching
// folds as Unicode does: 'ſ' (U+017F) matches s.
func contraction(s string, i int, fold bool) int {
	if s[i] != '\'' || i+1 >= len(s) {
		return 0
	}
	eq := func(j int, c byte) int { // bytes of the rune at j if it is c (or, folding, C or ſ for s)
		if j >= len(s) {
			return 0
		}
		if s[j] == c || fold && s[j] == c-'a'+'A' {
			return 1
		}
		if fold && c == 's' && j+1 < len(s) && s[j] == 0xc5 && s[j+1] == 0xbf {
			return 2
		}
		return 0
	}
	j := i + 1
	for _, one := range []byte{'s', 't', 'm', 'd'} {
		if n := eq(j, one); n > 0 {
			return 1 + n
		}
	}
	for _, two := range [][2]byte{{'r', 'e'}, {'v', 'e'}, {'l', 'l'}} {
		if n := eq(j, two[0]); n > 0 {
			if m := eq(j+n, two[1]); m > 0 {
				return 1 + n + m
			}
		}
	}
	return 0
}

// spaceRun matches \s+(?!\S)|\s+ at i (a space): the whole run of
// whitespace when the text ends with it, else the run less its last
// character (which then leads the next piece), or that one character
// when the run is only one long.
func spaceRun(s string, i int) int {
	end, last := i, i
	for end < len(s) {
		_, w, k := at(s, end)
		if k != classSpace {
			break
		}
		last = end
		end += w
	}
	if end == len(s) || last == i {
		return end
	}
	return last
}

// splitGPT2 matches gpt2Pattern.
func splitGPT2(s string, emit func(string)) {
	for i := 0; i < len(s); {
		e := matchGPT2(s, i)
		emit(s[i:e])
		i = e
	}
}

func matchGPT2(s string, i int) int {
	if n := contraction(s, i, false); n > 0 {
		return i + n
	}
	// ' ?\p{L}+', ' ?\p{N}+', ' ?[^\s\p{L}\p{N}]+': an optional ASCII
	// space, then a run of one class.
	j := i
	if s[i] == ' ' && i+1 < len(s) {
		if _, _, k := at(s, i+1); k != classSpace {
			j = i + 1
		}
	}
	if _, _, k := at(s, j); k != classSpace {
		return runOf(s, j, k)
	}
	return spaceRun(s, i)
}

// splitLlama3 matches llama3Pattern (digits = 3) or qwen2Pattern (1).
func splitLlama3(s string, digits int, emit func(string)) {
	for i := 0; i < len(s); {
		e := matchLlama3(s, i, digits)
		emit(s[i:e])
		i = e
	}
}

func matchLlama3(s string, i, digits int) int {
	if n := contraction(s, i, true); n > 0 {
		return i + n
	}
	r, w, k := at(s, i)
	// [^\r\n\p{L}\p{N}]?\p{L}+
	if k == classLetter {
		return runOf(s, i, classLetter)
	}
	if k != classNumber && r != '\r' && r != '\n' && i+w < len(s) {
		if _, _, k2 := at(s, i+w); k2 == classLetter {
			return runOf(s, i+w, classLetter)
		}
	}
	// \p{N}{1,3}
	if k == classNumber {
		e := i
		for n := 0; n < digits && e < len(s); n++ {
			_, w, k := at(s, e)
			if k != classNumber {
				break
			}
			e += w
		}
		return e
	}
	//  ?[^\s\p{L}\p{N}]+[\r\n]*
	j := -1
	switch {
	case k == classOther:
		j = i
	case r == ' ' && i+1 < len(s):
		if _, _, k2 := at(s, i+1); k2 == classOther {
			j = i + 1
		}
	}
	if j >= 0 {
		e := runOf(s, j, classOther)
		for e < len(s) && (s[e] == '\r' || s[e] == '\n') {
			e++
		}
		return e
	}
	// \s*[\r\n]+: through the last line break of the whitespace run.
	end, brk := i, -1
	for end < len(s) {
		r, w, k := at(s, end)
		if k != classSpace {
			break
		}
		if r == '\r' || r == '\n' {
			brk = end + 1
		}
		end += w
	}
	if brk >= 0 {
		return brk
	}
	return spaceRun(s, i)
}
