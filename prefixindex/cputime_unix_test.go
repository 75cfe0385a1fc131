//go:build unix

package prefixindex

import (
	"syscall"
	"testing"
	"time"
)

// processCPU is the CPU time the test process has used.
func processCPU() time.Duration {
	var ru syscall.Rusage
	if syscall.Getrusage(syscall.RUSAGE_SELF, &ru) != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// reportCPU adds the metric cpu-ns/op, the process's CPU time per
// operation since start. On a machine shared with other work a benchmark's
// ns/op counts the time it waited for a core; cpu-ns/op does not, so
// ratios of it hold up under load.
func reportCPU(b *testing.B, start time.Duration) {
	if start > 0 && b.N > 0 {
		b.ReportMetric(float64(processCPU()-start)/float64(b.N), "cpu-ns/op")
	}
}
