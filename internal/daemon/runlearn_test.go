package daemon

import (
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/nixcage/nixcage/internal/bus"
	"github.com/nixcage/nixcage/internal/policy"
	"github.com/nixcage/nixcage/internal/render"
)

// cagectl run --learn: the run's agent is validated like a declared one
// with learn = true (the default window, or --learn-for), and its gateway
// document carries the window and the shipped deny lists; a window the
// config refuses is refused for a run too.
func TestRunLearnAgent(t *testing.T) {
	cfg := filepath.Join(t.TempDir(), "nixcage.hcl")
	if err := os.WriteFile(cfg, []byte("version = 1\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	d := &Daemon{o: Options{Config: cfg}}
	req := bus.RunRequest{Backend: "service", Policy: "none", Command: []string{"/bin/true"}, Learn: true}
	a, _, err := d.runAgent(runAgentDoc(req, "run-learn"))
	if err != nil {
		t.Fatal(err)
	}
	rt := render.Runtime(a)
	if rt.Learn == nil || rt.Learn.ForSeconds != int64(policy.DefaultLearnDuration/time.Second) || policy.MatchDeny(rt.Learn.Deny, "statsig.anthropic.com") == "" {
		t.Fatalf("learn block %+v", rt.Learn)
	}
	req.LearnSeconds = 600
	if a, _, err = d.runAgent(runAgentDoc(req, "run-learn")); err != nil || a.Learn.For != 10*time.Minute {
		t.Fatalf("--learn-for 10m: %+v %v", a, err)
	}
	req.LearnSeconds = 30
	if _, _, err := d.runAgent(runAgentDoc(req, "run-learn")); err == nil {
		t.Fatal("a 30s learn window was accepted")
	}
}
