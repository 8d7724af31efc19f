package daemon

import (
	"errors"
	"fmt"
	"strings"
	"testing"

	"github.com/nixcage/nixcage/internal/bus"
)

// One caller's throw-away cages are bounded; another caller's are not
// counted against it, and a name is still taken by one run only.
func TestRunsPerCallerBounded(t *testing.T) {
	d := &Daemon{}
	for i := range maxRunsPerCaller {
		if err := d.registerRun(&run{name: fmt.Sprintf("a%d", i), uid: 1000}); err != nil {
			t.Fatalf("run %d of %d refused: %v", i+1, maxRunsPerCaller, err)
		}
	}
	err := d.registerRun(&run{name: "one-more", uid: 1000})
	if !errors.Is(err, bus.ErrBusy) || !strings.Contains(err.Error(), "end one first") {
		t.Fatalf("run %d of one caller: %v; want a refusal naming the bound", maxRunsPerCaller+1, err)
	}
	if d.runs["one-more"] != nil {
		t.Fatal("the refused run was registered")
	}
	if err := d.registerRun(&run{name: "other", uid: 1001}); err != nil {
		t.Fatalf("another caller's run refused: %v", err)
	}
	if err := d.registerRun(&run{name: "other", uid: 1002}); !errors.Is(err, bus.ErrInvalid) {
		t.Fatalf("a second run of a name: %v; want the name refused", err)
	}
}
