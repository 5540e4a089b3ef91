package evidence

import (
	"go/ast"
	"go/parser"
	"go/token"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// TestEveryRejectionReasonStartsAtZero: each reason the webhook listener counts a refused
// delivery under, its own and the signature's (target.SignatureError), is in
// rejectionReasons, whose series start at 0 for each target so that an alert sees the
// first refusal. A reason given anywhere but as a literal, or a SignatureError's Reason,
// fails the test: it could not be checked.
func TestEveryRejectionReasonStartsAtZero(t *testing.T) {
	used := map[string]string{}
	inspect(t, "webhook.go", func(n ast.Node, at string) {
		call, ok := n.(*ast.CallExpr)
		if !ok {
			return
		}
		if sel, ok := call.Fun.(*ast.SelectorExpr); !ok || sel.Sel.Name != "Rejected" {
			return
		}
		require.Len(t, call.Args, 3, "%s: Rejected(ctx, target, reason)", at)
		switch reason := call.Args[2].(type) {
		case *ast.BasicLit:
			if target, ok := call.Args[1].(*ast.BasicLit); ok && target.Value == `""` {
				return // a path no target has: counted without one, not started at 0
			}
			used[unquote(t, reason.Value)] = at
		case *ast.SelectorExpr:
			require.Equal(t, "Reason", reason.Sel.Name, "%s: a reason the test cannot read", at)
		default:
			t.Fatalf("%s: a reason the test cannot read", at)
		}
	})
	inspect(t, filepath.Join("..", "target", "evidence.go"), func(n ast.Node, at string) {
		lit, ok := n.(*ast.CompositeLit)
		if !ok {
			return
		}
		if id, ok := lit.Type.(*ast.Ident); !ok || id.Name != "SignatureError" {
			return
		}
		require.NotEmpty(t, lit.Elts, "%s: a SignatureError without a reason", at)
		reason, ok := lit.Elts[0].(*ast.BasicLit)
		require.True(t, ok, "%s: a reason the test cannot read", at)
		used[unquote(t, reason.Value)] = at
	})
	require.Contains(t, used, "mismatch", "the signature's reasons were read")
	for reason, at := range used {
		require.Contains(t, rejectionReasons, reason, "%s: not started at 0", at)
	}
	for _, reason := range rejectionReasons {
		require.Contains(t, used, reason, "listed but never given")
	}
}

// TestEveryQuarantineReasonIsListed: each Reason constant of this package is in Reasons,
// which the decided counter starts at 0 and the API documents.
func TestEveryQuarantineReasonIsListed(t *testing.T) {
	files, err := filepath.Glob("*.go")
	require.NoError(t, err)
	declared := map[string]string{}
	for _, file := range files {
		if strings.HasSuffix(file, "_test.go") {
			continue
		}
		inspect(t, file, func(n ast.Node, at string) {
			spec, ok := n.(*ast.ValueSpec)
			if !ok {
				return
			}
			for i, name := range spec.Names {
				if !strings.HasPrefix(name.Name, "Reason") || name.Name == "Reasons" {
					continue
				}
				value, ok := spec.Values[i].(*ast.BasicLit)
				require.True(t, ok, "%s: a reason the test cannot read", at)
				declared[unquote(t, value.Value)] = name.Name
			}
		})
	}
	require.Contains(t, declared, ReasonUnmatched, "the constants were read")
	for value, name := range declared {
		require.Contains(t, Reasons, value, "%s is not in Reasons", name)
	}
	require.Len(t, Reasons, len(declared), "Reasons lists only the constants, each once")
}

// inspect calls f for every node of a Go file, with the node's position.
func inspect(t *testing.T, file string, f func(n ast.Node, at string)) {
	t.Helper()
	fset := token.NewFileSet()
	parsed, err := parser.ParseFile(fset, file, nil, 0)
	require.NoError(t, err)
	ast.Inspect(parsed, func(n ast.Node) bool {
		if n != nil {
			f(n, fset.Position(n.Pos()).String())
		}
		return true
	})
}

func unquote(t *testing.T, s string) string {
	t.Helper()
	u, err := strconv.Unquote(s)
	require.NoError(t, err)
	return u
}
