package opcode

import (
	"strings"
	"testing"

	"github.com/batchfit/batchfit/graph"
)

func TestHeader(t *testing.T) {
	e := Enum{Prefix: "U_", List: "UNARY_OPS", Doc: "Unary.", Names: []Name{
		{Op: graph.OpNeg}, {Op: graph.OpGelu, Note: "exact"}, {Op: graph.OpGelu, Variant: "tanh"},
	}}
	h := string(Header(e))
	for _, want := range []string{"  U_NEG = 0,\n", "  U_GELU = 1,  // exact\n", "  U_GELU_TANH = 2\n",
		"#define UNARY_OPS(X) X(U_NEG) X(U_GELU) X(U_GELU_TANH)\n"} {
		if !strings.Contains(h, want) {
			t.Errorf("header lacks %q:\n%s", want, h)
		}
	}
	if c := e.Code(graph.OpGelu, "tanh"); c != 2 {
		t.Errorf("gelu tanh code %d, want 2", c)
	}
	if c := e.Code(graph.OpExp, ""); c != -1 {
		t.Errorf("exp's code %d, want -1 (not in the enum)", c)
	}
}
