package tokenizer

import (
	"strings"
	"unicode/utf8"
)

// byteChars maps each byte to the printable character GPT-2's byte-level
// alphabet stands it for (bytes_to_unicode): printable Latin-1 bytes map
// to themselves, the other 68 to U+0100 onwards in byte order.
var byteChars, charBytes = func() (bc [256]string, cb map[rune]byte) {
	cb = map[rune]byte{}
	n := 0
	for b := range 256 {
		r := rune(b)
		if !(b >= '!' && b <= '~' || b >= 0xa1 && b <= 0xac || b >= 0xae) {
			r = rune(256 + n)
			n++
		}
		bc[b] = string(r)
		cb[r] = byte(b)
	}
	return bc, cb
}()

// byteLevel maps raw text to the byte-level alphabet.
func byteLevel(s string) string {
	var b strings.Builder
	b.Grow(2 * len(s))
	for i := 0; i < len(s); i++ {
		b.WriteString(byteChars[s[i]])
	}
	return b.String()
}

// appendDecoded appends a token's bytes as the ByteLevel decoder gives
// them: each character mapped back to its byte, or, when some character
// is not in the alphabet (an added token such as "<|endoftext|>" is, one
// with a space is not), the token's own UTF-8.
func appendDecoded(out []byte, tok string) []byte {
	start := len(out)
	for _, r := range tok {
		b, ok := charBytes[r]
		if !ok {
			return append(out[:start], tok...)
		}
		out = append(out, b)
	}
	return out
}

// lossyString converts bytes to a string as Rust's String::from_utf8_lossy
// does: each maximal invalid subsequence (a truncated sequence counts as
// one) becomes one U+FFFD.
func lossyString(b []byte) string {
	if utf8.Valid(b) {
		return string(b)
	}
	var s strings.Builder
	for i := 0; i < len(b); {
		if r, w := utf8.DecodeRune(b[i:]); r != utf8.RuneError || w > 1 {
			s.Write(b[i : i+w])
			i += w
			continue
		}
		s.WriteRune(utf8.RuneError)
		i += invalidPrefix(b[i:])
	}
	return s.String()
}

// invalidPrefix is the length of the maximal prefix of b that begins a
// valid UTF-8 sequence but does not complete one (at least 1).
func invalidPrefix(b []byte) int {
	c := b[0]
	var n int
	lo, hi := byte(0x80), byte(0xbf) // the second byte's range
	switch {
	case c >= 0xc2 && c <= 0xdf:
		n = 2
	case c >= 0xe0 && c <= 0xef:
		n = 3
		if c == 0xe0 {
			lo = 0xa0
		} else if c == 0xed {
			hi = 0x9f
		}
	case c >= 0xf0 && c <= 0xf4:
		n = 4
		if c == 0xf0 {
			lo = 0x90
		} else if c == 0xf4 {
			hi = 0x8f
		}
	default:
		return 1
	}
	i := 1
	for ; i < n && i < len(b); i++ {
		if i == 1 && (b[i] < lo || b[i] > hi) || i > 1 && (b[i] < 0x80 || b[i] > 0xbf) {
			break
		}
	}
	return i
}
