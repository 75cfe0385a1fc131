package caddyllmaffinity_test

import (
	"bytes"
	"os"
	"os/exec"
	"regexp"
	"strings"
	"testing"
)

// trackedFiles lists the files git tracks, or skips when this is not a
// git checkout (a module downloaded through the proxy).
func trackedFiles(t *testing.T) []string {
	t.Helper()
	out, err := exec.Command("git", "ls-files", "-z").Output()
	if err != nil {
		t.Skipf("not a git checkout: %v", err)
	}
	var files []string
	for _, f := range strings.Split(string(out), "\x00") {
		if f != "" {
			files = append(files, f)
		}
	}
	return files
}

// TestNoTrackedBinaries: a clone carries no executables (build outputs
// belong in .gitignore).
func TestNoTrackedBinaries(t *testing.T) {
	magics := map[string][]byte{
		"ELF": []byte("\x7fELF"), "Mach-O": {0xcf, 0xfa, 0xed, 0xfe}, "Mach-O 32": {0xce, 0xfa, 0xed, 0xfe},
		"PE": []byte("MZ"), "Mach-O fat": {0xca, 0xfe, 0xba, 0xbe},
	}
	for _, f := range trackedFiles(t) {
		head := make([]byte, 4)
		file, err := os.Open(f)
		if err != nil {
			continue // deleted in the working tree
		}
		n, _ := file.Read(head)
		file.Close()
		for kind, magic := range magics {
			if bytes.HasPrefix(head[:n], magic) {
				t.Errorf("%s is a tracked %s executable", f, kind)
			}
		}
	}
}

// TestNoReferencesOutsideTheRepository: nothing tracked points at the
// notes folder beside the checkout or at an absolute path of the machine
// it was written on; a clone must stand on its own.
func TestNoReferencesOutsideTheRepository(t *testing.T) {
	outside := regexp.MustCompile(`\.\./` + `shared|/` + `work/`)
	for _, f := range trackedFiles(t) {
		body, err := os.ReadFile(f)
		if err != nil || bytes.IndexByte(body, 0) >= 0 {
			continue // deleted, or binary data
		}
		for i, line := range strings.Split(string(body), "\n") {
			if outside.MatchString(line) {
				t.Errorf("%s:%d refers outside the repository: %s", f, i+1, strings.TrimSpace(line))
			}
		}
	}
}
