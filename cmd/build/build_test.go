package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"go/parser"
	"go/token"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
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

// TestManifestMatchesGoMod checks that xcaddy.json pins the Caddy version that go.mod
// requires, lists this module as a plugin, and replaces that plugin version with this checkout.
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

	var selfVersion string
	for _, p := range b.Plugins {
		if p.PackagePath == self {
			selfVersion = p.Version
		} else if strings.HasPrefix(p.PackagePath, self+"/") {
			// A package path inside this unpublished module makes `go get` ask the
			// module proxy for the longer path, which fails; the root package
			// imports every plugin package instead.
			t.Errorf("plugin %s: list the module path %s, not a package inside it", p.PackagePath, self)
		}
	}
	if selfVersion == "" {
		t.Fatalf("xcaddy.json plugins do not list %s with a version; got %+v", self, b.Plugins)
	}
	if err := module.Check(self, selfVersion); err != nil {
		t.Errorf("plugin version: %v", err)
	}

	wantOld := self + "@" + selfVersion
	var replaced bool
	for _, r := range b.Replacements {
		if string(r.Old) == self {
			t.Errorf("replacement old %q: pin the version (%s), or go get asks the module proxy for %s", r.Old, wantOld, self)
		}
		if string(r.Old) != wantOld {
			continue
		}
		replaced = true
		if string(r.New) != root {
			t.Errorf("replacement %s => %s, want this checkout %s", r.Old, r.New, root)
		}
	}
	if !replaced {
		t.Errorf("xcaddy.json has no replacement for %s", wantOld)
	}
}

// TestRootPackageImportsPlugins checks that the module's root package, which xcaddy imports
// for the plugin entry, pulls in the Caddy modules that `list-modules` should show.
func TestRootPackageImportsPlugins(t *testing.T) {
	root := repoRoot(t)
	self := parseGoMod(t, root).Module.Mod.Path
	pkgs, err := parser.ParseDir(token.NewFileSet(), root, func(fi os.FileInfo) bool {
		return !strings.HasSuffix(fi.Name(), "_test.go")
	}, parser.ImportsOnly)
	if err != nil {
		t.Fatal(err)
	}
	imports := map[string]bool{}
	for _, p := range pkgs {
		for _, f := range p.Files {
			for _, imp := range f.Imports {
				path, _ := strconv.Unquote(imp.Path.Value)
				imports[path] = true
			}
		}
	}
	if len(pkgs) != 1 {
		t.Fatalf("want one Go package in the module root (what xcaddy imports), found %d", len(pkgs))
	}
	for _, want := range []string{self + "/caddyllm", self + "/kvsim/caddykvsim"} {
		if !imports[want] {
			t.Errorf("root package does not import %s", want)
		}
	}
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
