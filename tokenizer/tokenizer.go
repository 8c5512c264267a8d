package tokenizer

import (
	"bytes"
	"encoding/json"
	"fmt"
	"slices"
	"strings"
	"unicode"
	"unicode/utf8"
)

// Bounds on a tokenizer.json: Llama 3's is 9 MB with 128,256 tokens.
const (
	MaxFileBytes = 64 << 20
	maxVocab     = 1 << 22
)

// Tokenizer is a byte-level BPE tokenizer read from Hugging Face's
// tokenizer.json. It is safe for concurrent use.
type Tokenizer struct {
	model *bpe
	// steps are the pre-tokenizers' splits, in order; the last is
	// ByteLevel's, whose byte-level mapping is the model's input.
	steps []step
	added []addedToken
	// rawAdded and normAdded match the added tokens that skip
	// normalization (special tokens) and those that do not, in that
	// order, as tokenizers' AddedVocabulary does.
	rawAdded, normAdded matcher
	tokens              []string // by id: the vocabulary and the added tokens
	special             []bool   // by id: an added special token
	template            []templateItem
}

// step is one pre-tokenizer: it splits a piece into pieces.
type step struct {
	prefixSpace bool     // ByteLevel's add_prefix_space
	split       splitter // nil: no split
}

type templateItem struct {
	ids      []int32 // a special token's ids
	sequence bool    // the encoded text itself
}

// Load reads a tokenizer.json: a regular file of at most MaxFileBytes.
func Load(path string) (*Tokenizer, error) {
	b, err := readFile(path)
	if err != nil {
		return nil, err
	}
	t, err := Parse(b)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	return t, nil
}

type fileJSON struct {
	Truncation    json.RawMessage `json:"truncation"`
	Padding       json.RawMessage `json:"padding"`
	AddedTokens   []addedToken    `json:"added_tokens"`
	Normalizer    json.RawMessage `json:"normalizer"`
	PreTokenizer  json.RawMessage `json:"pre_tokenizer"`
	PostProcessor json.RawMessage `json:"post_processor"`
	Decoder       json.RawMessage `json:"decoder"`
	Model         json.RawMessage `json:"model"`
}

type modelJSON struct {
	Type                    string           `json:"type"`
	Dropout                 *float64         `json:"dropout"`
	UnkToken                *string          `json:"unk_token"`
	ContinuingSubwordPrefix *string          `json:"continuing_subword_prefix"`
	EndOfWordSuffix         *string          `json:"end_of_word_suffix"`
	FuseUnk                 bool             `json:"fuse_unk"`
	ByteFallback            bool             `json:"byte_fallback"`
	IgnoreMerges            bool             `json:"ignore_merges"`
	Vocab                   map[string]int64 `json:"vocab"`
	Merges                  json.RawMessage  `json:"merges"`
}

type addedToken struct {
	ID         int64  `json:"id"`
	Content    string `json:"content"`
	SingleWord bool   `json:"single_word"`
	LStrip     bool   `json:"lstrip"`
	RStrip     bool   `json:"rstrip"`
	Normalized bool   `json:"normalized"`
	Special    bool   `json:"special"`
}

// component is the "type" of a tokenizer.json component.
type component struct {
	Type string `json:"type"`
}

func isNull(m json.RawMessage) bool { return len(m) == 0 || string(m) == "null" }

func unsupported(what, typ string) error {
	return fmt.Errorf("%w: %s %q (supported: byte-level BPE as GPT-2, Llama 3 and Qwen2 tokenizers use it)", ErrUnsupported, what, typ)
}

// Parse builds a tokenizer from tokenizer.json's bytes.
func Parse(b []byte) (*Tokenizer, error) {
	if len(b) > MaxFileBytes {
		return nil, fmt.Errorf("%w: %d bytes, at most %d", ErrTooLarge, len(b), MaxFileBytes)
	}
	var f fileJSON
	if err := json.Unmarshal(b, &f); err != nil {
		return nil, fmt.Errorf("%w: %v", ErrFormat, err)
	}
	if !isNull(f.Truncation) {
		return nil, fmt.Errorf("%w: truncation is set; truncate ids after encoding instead", ErrUnsupported)
	}
	if !isNull(f.Padding) {
		return nil, fmt.Errorf("%w: padding is set; pad ids after encoding instead", ErrUnsupported)
	}
	if !isNull(f.Normalizer) {
		var c component
		_ = json.Unmarshal(f.Normalizer, &c)
		return nil, unsupported("normalizer", c.Type)
	}
	t := &Tokenizer{}
	if err := t.parseModel(f.Model); err != nil {
		return nil, err
	}
	if err := t.parseAdded(f.AddedTokens); err != nil {
		return nil, err
	}
	byteLevelSeen, err := t.parsePreTokenizer(f.PreTokenizer)
	if err != nil {
		return nil, err
	}
	if !byteLevelSeen {
		return nil, fmt.Errorf("%w: no ByteLevel pre-tokenizer: only byte-level BPE is implemented", ErrUnsupported)
	}
	if err := t.parseDecoder(f.Decoder); err != nil {
		return nil, err
	}
	if err := t.parsePostProcessor(f.PostProcessor); err != nil {
		return nil, err
	}
	return t, nil
}

func (t *Tokenizer) parseModel(raw json.RawMessage) error {
	var m modelJSON
	if err := json.Unmarshal(raw, &m); err != nil || isNull(raw) {
		return fmt.Errorf("%w: model: %v", ErrFormat, err)
	}
	if m.Type == "" && m.Merges != nil {
		m.Type = "BPE"
	}
	switch {
	case m.Type != "BPE":
		return unsupported("model", m.Type)
	case m.Dropout != nil && *m.Dropout != 0:
		return fmt.Errorf("%w: BPE dropout %g (random segmentations)", ErrUnsupported, *m.Dropout)
	case m.ContinuingSubwordPrefix != nil && *m.ContinuingSubwordPrefix != "":
		return fmt.Errorf("%w: BPE continuing_subword_prefix %q", ErrUnsupported, *m.ContinuingSubwordPrefix)
	case m.EndOfWordSuffix != nil && *m.EndOfWordSuffix != "":
		return fmt.Errorf("%w: BPE end_of_word_suffix %q", ErrUnsupported, *m.EndOfWordSuffix)
	case len(m.Vocab) > maxVocab:
		return fmt.Errorf("%w: %d tokens, at most %d", ErrTooLarge, len(m.Vocab), maxVocab)
	}
	bm := &bpe{vocab: make(map[string]int32, len(m.Vocab)), merges: map[uint64]merge{}, unk: -1,
		fuseUnk: m.FuseUnk, byteFallback: m.ByteFallback, ignoreMerges: m.IgnoreMerges, cache: map[string][]int32{}}
	for tok, id := range m.Vocab {
		if id < 0 || id >= maxVocab {
			return fmt.Errorf("%w: token %q has id %d, outside [0, %d)", ErrFormat, tok, id, maxVocab)
		}
		if int(id) < len(t.tokens) && t.tokens[id] != "" {
			return fmt.Errorf("%w: tokens %q and %q share id %d", ErrFormat, tok, t.tokens[id], id)
		}
		if tok == "" {
			return fmt.Errorf("%w: an empty token (id %d)", ErrFormat, id)
		}
		bm.vocab[tok] = int32(id)
		t.setToken(int32(id), tok)
	}
	for b := range 256 {
		bm.byteID[b] = -1
		if id, ok := bm.vocab[byteChars[b]]; ok {
			bm.byteID[b] = id
		}
	}
	if m.UnkToken != nil {
		id, ok := bm.vocab[*m.UnkToken]
		if !ok {
			return fmt.Errorf("%w: unk_token %q is not in the vocabulary", ErrFormat, *m.UnkToken)
		}
		bm.unk = id
	}
	pairs, err := parseMerges(m.Merges)
	if err != nil {
		return err
	}
	for rank, p := range pairs {
		a, okA := bm.vocab[p[0]]
		b, okB := bm.vocab[p[1]]
		id, okC := bm.vocab[p[0]+p[1]]
		if !okA || !okB || !okC {
			return fmt.Errorf("%w: merge %d (%q %q) uses or makes a token outside the vocabulary", ErrFormat, rank, p[0], p[1])
		}
		if _, dup := bm.merges[pairKey(a, b)]; !dup { // the first rank wins, as in tokenizers
			bm.merges[pairKey(a, b)] = merge{rank: int32(rank), id: id}
		}
	}
	t.model = bm
	return nil
}

// setToken records id's string, growing the table.
func (t *Tokenizer) setToken(id int32, tok string) {
	for int(id) >= len(t.tokens) {
		t.tokens = append(t.tokens, "")
		t.special = append(t.special, false)
	}
	t.tokens[id] = tok
}

// parseMerges reads merges in either spelling: "a b" strings (older
// files) or ["a", "b"] pairs.
func parseMerges(raw json.RawMessage) ([][2]string, error) {
	if isNull(raw) {
		return nil, nil
	}
	var items []json.RawMessage
	if err := json.Unmarshal(raw, &items); err != nil {
		return nil, fmt.Errorf("%w: merges: %v", ErrFormat, err)
	}
	if len(items) > maxVocab {
		return nil, fmt.Errorf("%w: %d merges, at most %d", ErrTooLarge, len(items), maxVocab)
	}
	out := make([][2]string, len(items))
	for i, it := range items {
		var s string
		if err := json.Unmarshal(it, &s); err == nil {
			a, b, ok := strings.Cut(s, " ")
			if !ok || strings.Contains(b, " ") {
				return nil, fmt.Errorf("%w: merge %d %q is not two tokens", ErrFormat, i, s)
			}
			out[i] = [2]string{a, b}
			continue
		}
		var p []string
		if err := json.Unmarshal(it, &p); err != nil || len(p) != 2 {
			return nil, fmt.Errorf("%w: merge %d is neither \"a b\" nor [a, b]", ErrFormat, i)
		}
		out[i] = [2]string{p[0], p[1]}
	}
	return out, nil
}

func (t *Tokenizer) parseAdded(tokens []addedToken) error {
	var raw, norm []addedToken
	for _, a := range tokens {
		if a.ID < 0 || a.ID >= maxVocab || a.Content == "" || !utf8.ValidString(a.Content) {
			return fmt.Errorf("%w: added token %q with id %d", ErrFormat, a.Content, a.ID)
		}
		if int(a.ID) < len(t.tokens) && t.tokens[a.ID] != "" && t.tokens[a.ID] != a.Content {
			return fmt.Errorf("%w: added token %q takes id %d from %q", ErrFormat, a.Content, a.ID, t.tokens[a.ID])
		}
		t.setToken(int32(a.ID), a.Content)
		t.special[a.ID] = a.Special
		t.added = append(t.added, a)
		if a.Normalized && !a.Special {
			norm = append(norm, a)
		} else {
			raw = append(raw, a)
		}
	}
	t.rawAdded, t.normAdded = newMatcher(raw), newMatcher(norm)
	return nil
}

// preTokenizerJSON is one pre-tokenizer of tokenizer.json.
type preTokenizerJSON struct {
	Type           string            `json:"type"`
	PreTokenizers  []json.RawMessage `json:"pretokenizers"`
	AddPrefixSpace bool              `json:"add_prefix_space"`
	UseRegex       *bool             `json:"use_regex"`
	Pattern        struct {
		Regex  *string `json:"Regex"`
		String *string `json:"String"`
	} `json:"pattern"`
	Behavior string `json:"behavior"`
	Invert   bool   `json:"invert"`
}

// flatten lists the pre-tokenizers of raw in order, Sequences opened.
func flatten(raw json.RawMessage, depth int) ([]preTokenizerJSON, error) {
	if isNull(raw) {
		return nil, nil
	}
	if depth > 8 {
		return nil, fmt.Errorf("%w: pre_tokenizer Sequences nested too deep", ErrFormat)
	}
	var c preTokenizerJSON
	if err := json.Unmarshal(raw, &c); err != nil {
		return nil, fmt.Errorf("%w: pre_tokenizer: %v", ErrFormat, err)
	}
	if c.Type != "Sequence" {
		return []preTokenizerJSON{c}, nil
	}
	var out []preTokenizerJSON
	for _, p := range c.PreTokenizers {
		cs, err := flatten(p, depth+1)
		if err != nil {
			return nil, err
		}
		out = append(out, cs...)
	}
	return out, nil
}

// parsePreTokenizer turns the pre-tokenizers into steps. ByteLevel must
// come last: its alphabet is the BPE model's input.
func (t *Tokenizer) parsePreTokenizer(raw json.RawMessage) (byteLevel bool, err error) {
	cs, err := flatten(raw, 0)
	if err != nil {
		return false, err
	}
	for i, c := range cs {
		if byteLevel {
			return false, fmt.Errorf("%w: pre-tokenizer %s after ByteLevel", ErrUnsupported, c.Type)
		}
		switch c.Type {
		case "ByteLevel":
			byteLevel = true
			s := step{prefixSpace: c.AddPrefixSpace}
			if c.UseRegex == nil || *c.UseRegex {
				s.split = splitGPT2
			}
			t.steps = append(t.steps, s)
		case "Split":
			if c.Pattern.Regex == nil {
				str := "(none)"
				if c.Pattern.String != nil {
					str = *c.Pattern.String
				}
				return false, fmt.Errorf("%w: Split on the string %q", ErrUnsupported, str)
			}
			sp, ok := knownSplitters[*c.Pattern.Regex]
			if !ok {
				return false, fmt.Errorf("%w: Split regex %q: only the GPT-2, Llama 3 and Qwen2 patterns are implemented", ErrUnsupported, *c.Pattern.Regex)
			}
			if c.Behavior != "Isolated" || c.Invert {
				return false, fmt.Errorf("%w: Split behavior %q (invert %v); only Isolated is implemented", ErrUnsupported, c.Behavior, c.Invert)
			}
			t.steps = append(t.steps, step{split: sp})
		default:
			return false, unsupported(fmt.Sprintf("pre-tokenizer %d", i), c.Type)
		}
	}
	return byteLevel, nil
}

func (t *Tokenizer) parseDecoder(raw json.RawMessage) error {
	var c component
	if err := json.Unmarshal(raw, &c); err != nil && !isNull(raw) {
		return fmt.Errorf("%w: decoder: %v", ErrFormat, err)
	}
	if c.Type != "ByteLevel" {
		if isNull(raw) {
			c.Type = "(none)"
		}
		return unsupported("decoder", c.Type)
	}
	return nil
}

func (t *Tokenizer) parsePostProcessor(raw json.RawMessage) error {
	if isNull(raw) {
		return nil
	}
	var c struct {
		Type       string            `json:"type"`
		Processors []json.RawMessage `json:"processors"`
		Single     []struct {
			SpecialToken *struct {
				ID string `json:"id"`
			} `json:"SpecialToken"`
			Sequence *struct {
				ID string `json:"id"`
			} `json:"Sequence"`
		} `json:"single"`
		SpecialTokens map[string]struct {
			IDs []int64 `json:"ids"`
		} `json:"special_tokens"`
	}
	if err := json.Unmarshal(raw, &c); err != nil {
		return fmt.Errorf("%w: post_processor: %v", ErrFormat, err)
	}
	switch c.Type {
	case "Sequence":
		for _, p := range c.Processors {
			if err := t.parsePostProcessor(p); err != nil {
				return err
			}
		}
		return nil
	case "ByteLevel": // adjusts offsets only
		return nil
	case "TemplateProcessing":
		if t.template != nil {
			return fmt.Errorf("%w: two TemplateProcessing post-processors", ErrUnsupported)
		}
		t.template = []templateItem{}
		for _, it := range c.Single {
			switch {
			case it.SpecialToken != nil:
				st, ok := c.SpecialTokens[it.SpecialToken.ID]
				if !ok {
					return fmt.Errorf("%w: template names special token %q it does not define", ErrFormat, it.SpecialToken.ID)
				}
				ids := make([]int32, len(st.IDs))
				for i, id := range st.IDs {
					if id < 0 || int(id) >= len(t.tokens) {
						return fmt.Errorf("%w: template token %q has id %d outside the vocabulary", ErrFormat, it.SpecialToken.ID, id)
					}
					ids[i] = int32(id)
				}
				t.template = append(t.template, templateItem{ids: ids})
			case it.Sequence != nil && it.Sequence.ID == "A":
				t.template = append(t.template, templateItem{sequence: true})
			default:
				return fmt.Errorf("%w: a single-sequence template item other than a special token or sequence A", ErrFormat)
			}
		}
		return nil
	}
	return unsupported("post-processor", c.Type)
}

// VocabSize is the number of ids, added tokens included.
func (t *Tokenizer) VocabSize() int { return len(t.tokens) }

// TokenID is the id of a token (in the byte-level alphabet for vocabulary
// tokens, as written for added ones).
func (t *Tokenizer) TokenID(tok string) (int, bool) {
	for _, a := range t.added {
		if a.Content == tok {
			return int(a.ID), true
		}
	}
	id, ok := t.model.vocab[tok]
	return int(id), ok
}

// Token is the token with an id.
func (t *Tokenizer) Token(id int) (string, bool) {
	if id < 0 || id >= len(t.tokens) || t.tokens[id] == "" {
		return "", false
	}
	return t.tokens[id], true
}

// Encode tokenizes text as tokenizers' Tokenizer.encode does: added
// tokens are split out first, the rest pre-tokenized and merged; with
// addSpecial the post-processor's template (Llama 3's <|begin_of_text|>)
// is applied. Text must be valid UTF-8.
func (t *Tokenizer) Encode(text string, addSpecial bool) ([]int, error) {
	if !utf8.ValidString(text) {
		return nil, fmt.Errorf("%w: text is not valid UTF-8", ErrFormat)
	}
	ids := make([]int32, 0, len(text)/3+4)
	for _, seg := range t.rawAdded.split(text) {
		if seg.id >= 0 {
			ids = append(ids, seg.id)
			continue
		}
		for _, s2 := range t.normAdded.split(seg.text) {
			if s2.id >= 0 {
				ids = append(ids, s2.id)
				continue
			}
			ids = t.encodePlain(s2.text, ids)
		}
	}
	var out []int
	if addSpecial && t.template != nil {
		for _, it := range t.template {
			if it.sequence {
				out = appendInts(out, ids)
			} else {
				out = appendInts(out, it.ids)
			}
		}
		return out, nil
	}
	return appendInts(make([]int, 0, len(ids)), ids), nil
}

func appendInts(out []int, ids []int32) []int {
	for _, id := range ids {
		out = append(out, int(id))
	}
	return out
}

// encodePlain pre-tokenizes text free of added tokens and runs the model
// on each piece.
func (t *Tokenizer) encodePlain(text string, ids []int32) []int32 {
	if text == "" {
		return ids
	}
	var run func(k int, piece string)
	run = func(k int, piece string) {
		if k == len(t.steps) {
			ids = t.model.tokenize(piece, ids)
			return
		}
		s := t.steps[k]
		if s.prefixSpace && !strings.HasPrefix(piece, " ") {
			piece = " " + piece
		}
		if s.split == nil {
			run(k+1, piece)
			return
		}
		s.split(piece, func(p string) { run(k+1, p) })
	}
	run(0, text)
	return ids
}

// Decode turns ids back into text with the ByteLevel decoder, as
// tokenizers' decode does; with skipSpecial, special added tokens are
// left out. An id outside the vocabulary is an ErrFormat error.
func (t *Tokenizer) Decode(ids []int, skipSpecial bool) (string, error) {
	var b []byte
	for _, id := range ids {
		tok, ok := t.Token(id)
		if !ok {
			return "", fmt.Errorf("%w: id %d is not in the vocabulary of %d", ErrFormat, id, len(t.tokens))
		}
		if skipSpecial && t.special[id] {
			continue
		}
		b = appendDecoded(b, tok)
	}
	return lossyString(b), nil
}

// matcher finds added tokens in text, leftmost-longest, as tokenizers'
// Aho-Corasick matcher does.
type matcher struct {
	byFirst *[256][]addedToken // candidates by first byte, longest first; nil without tokens
}

func newMatcher(tokens []addedToken) matcher {
	if len(tokens) == 0 {
		return matcher{}
	}
	m := matcher{byFirst: new([256][]addedToken)}
	for _, a := range tokens {
		m.byFirst[a.Content[0]] = append(m.byFirst[a.Content[0]], a)
	}
	for _, c := range m.byFirst {
		slices.SortStableFunc(c, func(a, b addedToken) int { return len(b.Content) - len(a.Content) })
	}
	return m
}

// segment is a run of text (id −1) or an added token.
type segment struct {
	text string
	id   int32
}

// split cuts text into added tokens and the text between them, applying
// the tokens' single_word, lstrip and rstrip options.
func (m matcher) split(text string) []segment {
	if m.byFirst == nil {
		return []segment{{text: text, id: -1}}
	}
	var out []segment
	last := 0 // end of the previous token
	for i := 0; i < len(text); {
		var hit *addedToken
		for k := range m.byFirst[text[i]] {
			if strings.HasPrefix(text[i:], m.byFirst[text[i]][k].Content) {
				hit = &m.byFirst[text[i]][k]
				break
			}
		}
		if hit == nil {
			i++
			continue
		}
		start, stop := i, i+len(hit.Content)
		i = stop
		if hit.SingleWord && (start > 0 && endsWithWord(text[:start]) || stop < len(text) && startsWithWord(text[stop:])) {
			continue
		}
		if hit.LStrip {
			s := strings.TrimRightFunc(text[:start], unicode.IsSpace)
			start = max(len(s), last)
		}
		if hit.RStrip {
			stop = len(text) - len(strings.TrimLeftFunc(text[stop:], unicode.IsSpace))
			i = stop
		}
		if last < start {
			out = append(out, segment{text: text[last:start], id: -1})
		}
		out = append(out, segment{text: text[start:stop], id: int32(hit.ID)})
		last = stop
	}
	if last < len(text) {
		out = append(out, segment{text: text[last:], id: -1})
	}
	return out
}

func isWordRune(r rune) bool { return r == '_' || unicode.IsLetter(r) || unicode.IsNumber(r) }

func endsWithWord(s string) bool {
	r, _ := utf8.DecodeLastRuneInString(s)
	return isWordRune(r)
}

func startsWithWord(s string) bool {
	r, _ := utf8.DecodeRuneInString(s)
	return isWordRune(r)
}

// readFile reads a tokenizer.json within MaxFileBytes.
func readFile(path string) ([]byte, error) {
	b, err := readBounded(path)
	if err != nil {
		return nil, err
	}
	return bytes.TrimPrefix(b, []byte("\xef\xbb\xbf")), nil
}
