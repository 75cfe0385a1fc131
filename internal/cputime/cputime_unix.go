//go:build unix

package cputime

import (
	"syscall"
	"time"
)

// process is the CPU time the process has used.
func process() time.Duration {
	var ru syscall.Rusage
	if syscall.Getrusage(syscall.RUSAGE_SELF, &ru) != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}
