package opcode

import "testing"

// TestEnumsDense: each enum's codes are 0, 1, … in header order, and no C
// name repeats, so the header's values are exactly the Go constants.
func TestEnumsDense(t *testing.T) {
	seen := map[string]bool{}
	for _, e := range Enums {
		for i, n := range e.Names {
			if n.Code != Code(i) {
				t.Errorf("%s is %d at position %d", n.C, n.Code, i)
			}
			if seen[n.C] {
				t.Errorf("%s declared twice", n.C)
			}
			seen[n.C] = true
		}
	}
}
