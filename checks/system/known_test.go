package system

import (
	"os"
	"strings"
	"testing"
)

// knownIssue is a defect these tests found in another component and reported
// to its owner. A test that hits one logs it with the fix and, unless
// NIXCAGE_SYSTEST_STRICT=1, skips or softens only the affected assertion, so
// the suite stays usable while the fix lands. Once fixed, the signature no
// longer shows up and the test runs in full; then delete the entry.
type knownIssue struct {
	id        string
	owner     string
	signature string // text in a unit's journal (or probe output) that identifies it
	fix       string
}

// knownIssues is empty: everything found so far (service cages seeing the
// host root, nspawn joining the netns, idmapped roots, store binds, podman
// user ranges and skeleton mount targets) was fixed in internal/render.
var knownIssues = []knownIssue{}

// strict reports whether known issues fail tests.
func strict() bool { return os.Getenv("NIXCAGE_SYSTEST_STRICT") == "1" }

// matchKnown returns the known issue whose signature occurs in text.
func matchKnown(text string) *knownIssue {
	for i := range knownIssues {
		if strings.Contains(text, knownIssues[i].signature) {
			return &knownIssues[i]
		}
	}
	return nil
}

// skipKnown skips the test if text shows a known issue (unless strict).
func skipKnown(t *testing.T, text string) {
	t.Helper()
	if k := matchKnown(text); k != nil {
		if strict() {
			t.Fatalf("KNOWN ISSUE %s (%s): %s", k.id, k.owner, k.fix)
		}
		t.Skipf("KNOWN ISSUE %s (%s), reported; fix: %s", k.id, k.owner, k.fix)
	}
}
