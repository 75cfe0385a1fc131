package kvsim

import (
	"os"
	"strings"
	"testing"
)

// TestReadmeListsEveryOption: kvsim/README.md's option and fault tables
// name every setting the Caddyfile, JSON and flags accept.
func TestReadmeListsEveryOption(t *testing.T) {
	readme, err := os.ReadFile("README.md")
	if err != nil {
		t.Fatal(err)
	}
	var c Config
	var f Faults
	for _, o := range append(c.Options(), f.Options()...) {
		if !strings.Contains(string(readme), "| `"+o.Name+"` |") {
			t.Errorf("README.md has no table row for %s", o.Name)
		}
	}
}
