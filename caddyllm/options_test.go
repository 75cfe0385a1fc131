package caddyllm

import (
	"go/ast"
	goparser "go/parser"
	"go/token"
	"os"
	"reflect"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
)

// caddyfileOptions lists the option names UnmarshalCaddyfile of recv
// accepts, read from caddyfile.go itself: the string cases of its
// switches and the keys of its option tables. An option added to the
// parser appears here with no further work.
func caddyfileOptions(t *testing.T, recv string) []string {
	t.Helper()
	f, err := goparser.ParseFile(token.NewFileSet(), "caddyfile.go", nil, 0)
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	add := func(e ast.Expr) {
		if lit, ok := e.(*ast.BasicLit); ok && lit.Kind == token.STRING {
			if s, err := strconv.Unquote(lit.Value); err == nil && regexp.MustCompile(`^[a-z_]+$`).MatchString(s) {
				names = append(names, s)
			}
		}
	}
	for _, decl := range f.Decls {
		fn, ok := decl.(*ast.FuncDecl)
		if !ok || fn.Name.Name != "UnmarshalCaddyfile" || fn.Recv == nil {
			continue
		}
		if star, ok := fn.Recv.List[0].Type.(*ast.StarExpr); !ok || star.X.(*ast.Ident).Name != recv {
			continue
		}
		ast.Inspect(fn.Body, func(n ast.Node) bool {
			switch n := n.(type) {
			case *ast.CaseClause:
				for _, e := range n.List {
					add(e)
				}
			case *ast.KeyValueExpr:
				add(n.Key)
			}
			return true
		})
	}
	slices.Sort(names)
	return slices.Compact(names)
}

// jsonNames lists the JSON field names of the config structs.
func jsonNames() map[string]bool {
	out := map[string]bool{}
	for _, v := range []any{Handler{}, Policy{}, HardwareProfile{}, SyncConfig{}} {
		typ := reflect.TypeOf(v)
		for i := range typ.NumField() {
			if name, _, _ := strings.Cut(typ.Field(i).Tag.Get("json"), ","); name != "" && name != "-" {
				out[name] = true
			}
		}
	}
	return out
}

// TestReadmeOptionTable: README.md's option table has a row for every
// Caddyfile option the parser accepts, and each row's JSON name is a field
// of the config; adding an option without a row fails here.
func TestReadmeOptionTable(t *testing.T) {
	readme, err := os.ReadFile("../README.md")
	if err != nil {
		t.Fatal(err)
	}
	rows := map[string]string{} // Caddyfile name → JSON name
	row := regexp.MustCompile("(?m)^\\| (handler|policy|sync) \\| `([a-z_]+)` \\| `([a-z_.]+|—)` \\|")
	for _, m := range row.FindAllStringSubmatch(string(readme), -1) {
		rows[m[1]+" "+m[2]] = m[3]
	}
	if len(rows) == 0 {
		t.Fatal("README.md has no option table")
	}
	sync := map[string]bool{"subject": true, "name": true, "creds": true, "tls_ca": true}
	for recv, scope := range map[string]string{"Handler": "handler", "Policy": "policy"} {
		for _, opt := range caddyfileOptions(t, recv) {
			if recv == "Policy" && sync[opt] {
				if _, ok := rows["sync "+opt]; !ok {
					t.Errorf("README.md's option table has no row for sync option %s", opt)
				}
				continue
			}
			if _, ok := rows[scope+" "+opt]; !ok {
				t.Errorf("README.md's option table has no row for %s option %s", scope, opt)
			}
		}
	}
	json := jsonNames()
	for key, name := range rows {
		last := name[strings.LastIndex(name, ".")+1:]
		if name != "—" && !json[last] {
			t.Errorf("README.md's row %s names JSON field %s, which no config struct has", key, name)
		}
	}
}
