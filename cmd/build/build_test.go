package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"golang.org/x/mod/modfile"
	"golang.org/x/mod/module"
)

const caddyModule = "github.com/caddyserver/caddy/v2"

// repoRoot is the directory holding go.mod, found from the test's working directory.
func repoRoot(t *testing.T) string {
	t.Helper()
	dir, err := filepath.Abs(".")
	if err != nil {
		t.Fatal(err)
	}
	for {
		if _, err := os.Stat(filepath.Join(dir, "go.mod")); err == nil {
			return dir
		}
		parent := filepath.Dir(dir)
		if parent == dir {
			t.Fatal("no go.mod above the test directory")
		}
		dir = parent
	}
}

func parseGoMod(t *testing.T, root string) *modfile.File {
	t.Helper()
	path := filepath.Join(root, "go.mod")
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	f, err := modfile.Parse(path, data, nil)
	if err != nil {
		t.Fatal(err)
	}
	return f
}

// kvsimPlugin is the package path of kvsim's Caddy module, relative to the module path.
const kvsimPlugin = "/kvsim/caddykvsim"

// TestManifestMatchesGoMod checks that xcaddy.json pins the Caddy version that go.mod
// requires, lists this module and kvsim's Caddy module as plugins, and replaces this module
// with this checkout in a way that never sends `go get` to the module proxy for it.
func TestManifestMatchesGoMod(t *testing.T) {
	root := repoRoot(t)
	gomod := parseGoMod(t, root)
	self := gomod.Module.Mod.Path

	var caddyVersion string
	for _, r := range gomod.Require {
		if r.Mod.Path == caddyModule {
			caddyVersion = r.Mod.Version
		}
	}
	if caddyVersion == "" {
		t.Fatalf("go.mod does not require %s", caddyModule)
	}
	for _, r := range gomod.Replace {
		if r.Old.Path == caddyModule {
			t.Errorf("go.mod replaces %s; xcaddy.json would build a different Caddy", caddyModule)
		}
	}

	b, err := loadBuilder(filepath.Join(root, manifestName))
	if err != nil {
		t.Fatal(err)
	}
	if b.CaddyVersion != caddyVersion {
		t.Errorf("xcaddy.json caddy_version = %q, go.mod requires %s %s", b.CaddyVersion, caddyModule, caddyVersion)
	}

	plugins := map[string]string{} // package path => version
	for _, p := range b.Plugins {
		plugins[p.PackagePath] = p.Version
	}
	// Without a version, `go get` asks the module proxy for the latest one, which it does
	// not have; with one, the replacement below answers.
	if v, ok := plugins[self]; !ok || v == "" {
		t.Errorf("xcaddy.json plugins do not list %s with a version; got %+v", self, b.Plugins)
	} else if err := module.Check(self, v); err != nil {
		t.Errorf("plugin version: %v", err)
	}
	// The quickstart and TestBuild need kvsim, which the root package does not register.
	if _, ok := plugins[self+kvsimPlugin]; !ok {
		t.Errorf("xcaddy.json plugins do not list %s%s", self, kvsimPlugin)
	}

	// xcaddy skips `go get` only for a plugin under a replaced path: a replacement pinned
	// to a version (self@v0.0.0) is no such path, and `go get` of a package inside the
	// module would ask the proxy for the longer paths and fail.
	var replaced bool
	for _, r := range b.Replacements {
		switch old := string(r.Old); {
		case strings.HasPrefix(old, self+"@"):
			t.Errorf("replacement old %q: replace %s without a version, so that the plugins inside it are not fetched", old, self)
		case old == self:
			replaced = true
			if string(r.New) != root {
				t.Errorf("replacement %s => %s, want this checkout %s", r.Old, r.New, root)
			}
		}
	}
	if !replaced {
		t.Errorf("xcaddy.json has no replacement for %s", self)
	}
}

// TestPluginDependencies checks, with `go list`, that the module's root package, which xcaddy
// imports for the plugin entry, is a single package that registers the router and pulls in
// nothing of kvsim, which production builds do not want; and that cmd/caddy, the quickstart's
// Caddy, adds kvsim's Caddy module itself.
func TestPluginDependencies(t *testing.T) {
	root := repoRoot(t)
	self := parseGoMod(t, root).Module.Mod.Path
	cmd := exec.Command("go", "list", "-deps", "-f", "{{.ImportPath}}", ".")
	cmd.Dir = root
	deps := goList(t, cmd)
	if !deps[self+"/caddyllm"] {
		t.Errorf("the root package does not depend on %s/caddyllm", self)
	}
	for dep := range deps {
		if dep == self+"/kvsim" || strings.HasPrefix(dep, self+"/kvsim/") {
			t.Errorf("the root package depends on %s", dep)
		}
	}

	cmd = exec.Command("go", "list", "-deps", "-f", "{{.ImportPath}}", "./cmd/caddy")
	cmd.Dir = root
	deps = goList(t, cmd)
	for _, want := range []string{self, self + kvsimPlugin} {
		if !deps[want] {
			t.Errorf("cmd/caddy does not depend on %s", want)
		}
	}
}

// goList runs a `go list` command that prints one import path per line and returns the set.
func goList(t *testing.T, cmd *exec.Cmd) map[string]bool {
	t.Helper()
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("%s: %v\n%s", strings.Join(cmd.Args, " "), err, stderr.String())
	}
	paths := map[string]bool{}
	for _, line := range strings.Fields(string(out)) {
		paths[line] = true
	}
	return paths
}

func TestLoadBuilder(t *testing.T) {
	dir := t.TempDir()
	write := func(s string) string {
		p := filepath.Join(dir, manifestName)
		if err := os.WriteFile(p, []byte(s), 0o644); err != nil {
			t.Fatal(err)
		}
		return p
	}

	b, err := loadBuilder(write(`{"caddy_version":"v2.11.9",
		"plugins":[{"module_path":"example.com/p","version":"v0.0.0"}],
		"replacements":[{"old":"example.com/p@v0.0.0","new":"./sub"},
			{"old":"example.com/q","new":"/abs/q"},
			{"old":"example.com/r","new":"example.com/r2 v1.2.3"}]}`))
	if err != nil {
		t.Fatal(err)
	}
	if got, want := string(b.Replacements[0].New), filepath.Join(dir, "sub"); got != want {
		t.Errorf("relative replacement resolved to %q, want %q", got, want)
	}
	if got := string(b.Replacements[1].New); got != "/abs/q" {
		t.Errorf("absolute replacement changed to %q", got)
	}
	if got := string(b.Replacements[2].New); got != "example.com/r2 v1.2.3" {
		t.Errorf("module replacement changed to %q", got)
	}

	for name, bad := range map[string]string{
		"unknown field":   `{"caddy_version":"v2.11.9","plugin":[]}`,
		"no version":      `{"plugins":[{"module_path":"example.com/p"}]}`,
		"empty plugin":    `{"caddy_version":"v2.11.9","plugins":[{"version":"v1.0.0"}]}`,
		"half replace":    `{"caddy_version":"v2.11.9","replacements":[{"old":"example.com/p"}]}`,
		"trailing object": `{"caddy_version":"v2.11.9"}{}`,
		"not json":        `caddy_version: v2.11.9`,
	} {
		if _, err := loadBuilder(write(bad)); err == nil {
			t.Errorf("%s: loaded without error", name)
		}
	}
}

func TestFindManifest(t *testing.T) {
	root := repoRoot(t)
	got, err := findManifest(filepath.Join(root, "cmd", "build"))
	if err != nil {
		t.Fatal(err)
	}
	if want := filepath.Join(root, manifestName); got != want {
		t.Errorf("findManifest = %q, want %q", got, want)
	}
}

func TestRunPrintAndHelp(t *testing.T) {
	root := repoRoot(t)
	var out, errOut bytes.Buffer
	if err := run([]string{"-print", "-goos", "linux", "-config", filepath.Join(root, manifestName)}, &out, &errOut); err != nil {
		t.Fatalf("run -print: %v\n%s", err, errOut.String())
	}
	var printed map[string]any
	if err := json.Unmarshal(out.Bytes(), &printed); err != nil {
		t.Fatalf("-print output is not JSON: %v\n%s", err, out.String())
	}
	if printed["caddy_version"] == nil || printed["plugins"] == nil || printed["os"] != "linux" {
		t.Errorf("-print output lacks caddy_version, plugins or os: %s", out.String())
	}

	out.Reset()
	errOut.Reset()
	if err := run([]string{"-help"}, &out, &errOut); !errors.Is(err, flag.ErrHelp) {
		t.Fatalf("run -help: err = %v", err)
	}
	for _, want := range []string{"xcaddy.json", "-o file", "-config file", "-print"} {
		if !strings.Contains(errOut.String(), want) {
			t.Errorf("help lacks %q:\n%s", want, errOut.String())
		}
	}

	if err := run([]string{"extra"}, &out, &errOut); err == nil {
		t.Error("run with a positional argument succeeded")
	}
}

// TestBuild runs the real build (a minute or more, network for a cold module cache). It only
// runs when XCADDY_BUILD_TEST=1.
func TestBuild(t *testing.T) {
	if os.Getenv("XCADDY_BUILD_TEST") != "1" {
		t.Skip("set XCADDY_BUILD_TEST=1 to build Caddy from xcaddy.json")
	}
	root := repoRoot(t)
	bin := filepath.Join(t.TempDir(), "caddy")
	var out, errOut bytes.Buffer
	if err := run([]string{"-o", bin, "-config", filepath.Join(root, manifestName)}, &out, &errOut); err != nil {
		t.Fatalf("build: %v\n%s", err, errOut.String())
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	mods, err := exec.CommandContext(ctx, bin, "list-modules").Output()
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{
		"http.handlers.llm_affinity",
		"http.reverse_proxy.selection_policies.llm_affinity",
		"http.handlers.kvsim",
	} {
		if !strings.Contains(string(mods), want+"\n") {
			t.Errorf("list-modules lacks %s", want)
		}
	}
}
