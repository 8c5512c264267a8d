package main

import (
	"flag"
	"os"
	"regexp"
	"slices"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// docs/cli.md lists every flag of every subcommand, and no other: a row
// of a subcommand's table names each flag (`--name ARG`), and a section
// that says it takes "the step flags" has the Step flags table's too.
func TestCLIDocListsEveryFlag(t *testing.T) {
	doc, err := os.ReadFile("../../docs/cli.md")
	require.NoError(t, err)
	sections := map[string]string{} // "## " heading → body
	var order []string
	for _, part := range strings.Split("\n"+string(doc), "\n## ")[1:] {
		head, body, _ := strings.Cut(part, "\n")
		sections[head] = body
		order = append(order, head)
	}
	row := regexp.MustCompile(`(?m)^\| ([^|]+) \|`)
	flagName := regexp.MustCompile("`--?([a-z0-9-]+)")
	documented := func(body string) []string {
		var names []string
		for _, m := range row.FindAllStringSubmatch(body, -1) {
			for _, f := range flagName.FindAllStringSubmatch(m[1], -1) {
				names = append(names, f[1])
			}
		}
		return names
	}
	step, ok := sections["Step flags"]
	require.True(t, ok, "a Step flags section; sections: %q", order)
	for name, fs := range docFlagSets() {
		body, ok := sections["`batchfit "+name+"`"]
		if !assert.True(t, ok, "docs/cli.md has no section for batchfit %s", name) {
			continue
		}
		got := documented(body)
		if strings.Contains(strings.Join(strings.Fields(body), " "), "the step flags") {
			got = append(got, documented(step)...)
		}
		var want []string
		fs.VisitAll(func(f *flag.Flag) { want = append(want, f.Name) })
		slices.Sort(got)
		slices.Sort(want)
		assert.Equal(t, want, slices.Compact(got), "batchfit %s: docs/cli.md against the flag definitions", name)
	}
}
