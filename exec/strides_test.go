package exec_test

import (
	"errors"
	"slices"
	"testing"

	"github.com/batchfit/batchfit/exec"
	"github.com/batchfit/batchfit/graph"
)

// TestLeadStrides pins the strides matmul walks its leading axes with: the
// operand's own strides scaled by the matrix size, 0 on broadcast axes and
// on axes the operand lacks.
func TestLeadStrides(t *testing.T) {
	for _, c := range []struct {
		s, lead []int
		inner   int
		want    []int
	}{
		{s: []int{2, 3}, lead: []int{2, 3}, inner: 6, want: []int{18, 6}},
		{s: []int{1, 3}, lead: []int{2, 3}, inner: 4, want: []int{0, 4}},
		{s: []int{3}, lead: []int{2, 3}, inner: 5, want: []int{0, 5}},
		{s: []int{}, lead: []int{2, 3}, inner: 5, want: []int{0, 0}},
		{s: []int{2, 1}, lead: []int{2, 3}, inner: 2, want: []int{2, 0}},
		{s: []int{}, lead: []int{}, inner: 7, want: []int{}},
	} {
		got, err := exec.LeadStrides(c.s, c.lead, c.inner)
		if err != nil || !slices.Equal(got, c.want) {
			t.Errorf("LeadStrides(%v, %v, %d) = %v, %v; want %v", c.s, c.lead, c.inner, got, err, c.want)
		}
	}
	for _, c := range [][2][]int{{{4}, {3}}, {{2, 2, 3}, {2, 3}}} {
		if _, err := exec.LeadStrides(c[0], c[1], 1); !errors.Is(err, graph.ErrShape) {
			t.Errorf("LeadStrides(%v, %v) = %v, want ErrShape", c[0], c[1], err)
		}
	}
}
