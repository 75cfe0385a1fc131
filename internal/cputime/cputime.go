// Package cputime reports a benchmark's CPU time per operation. On a
// machine shared with other work a benchmark's ns/op counts the time it
// waited for a core; cpu-ns/op does not, so ratios of it hold up under
// load.
package cputime

import (
	"testing"
	"time"
)

// Start is the process's CPU time now, to pass to Report.
func Start() time.Duration { return process() }

// Report adds the metric cpu-ns/op to b: the process's CPU time per
// operation since start. It reports nothing where the CPU time is unknown.
func Report(b *testing.B, start time.Duration) {
	if start > 0 && b.N > 0 {
		b.ReportMetric(float64(process()-start)/float64(b.N), "cpu-ns/op")
	}
}
