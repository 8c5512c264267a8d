package tokenizer_test

import (
	"fmt"
	"path/filepath"

	"github.com/batchfit/batchfit/tokenizer"
)

// Encode with and without the template's <|begin_of_text|>, and decode.
func Example() {
	tok, err := tokenizer.Load(filepath.Join("testdata", "llama3-style.json"))
	if err != nil {
		fmt.Println(err)
		return
	}
	ids, err := tok.Encode("Hello, world!", true)
	if err != nil {
		fmt.Println(err)
		return
	}
	fmt.Println(ids[0], len(ids))
	text, err := tok.Decode(ids, true)
	if err != nil {
		fmt.Println(err)
		return
	}
	fmt.Printf("%q\n", text)
	// Output:
	// 2000 12
	// "Hello, world!"
}
