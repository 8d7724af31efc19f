package config

import (
	"reflect"
	"testing"
	"time"

	"github.com/nixcage/nixcage/internal/policy"
)

// Learn mode and the approval queue: defaults filled in from the policy
// package (one default per knob), the shipped deny lists carried for the
// gateway, and the canonical JSON loads back to the same model.
func TestLearnAndApprovalModel(t *testing.T) {
	src := `
agent "a" {
  command = ["/bin/true"]
  learn   = true
  approval {}
}
agent "b" {
  command   = ["/bin/true"]
  learn     = true
  learn_for = "10m"
  approval {
    wait        = "45s"
    max_pending = 2
  }
}
agent "c" {
  command = ["/bin/true"]
}`
	cfg, diags := NewLoader().Load(Source{Name: "l.hcl", Data: []byte(src)})
	if diags.HasErrors() {
		t.Fatal(diags)
	}
	a, b, c := cfg.Agent("a"), cfg.Agent("b"), cfg.Agent("c")
	if a.Learn == nil || a.Learn.For != policy.DefaultLearnDuration || len(a.Learn.Deny) == 0 || policy.MatchDeny(a.Learn.Deny, "statsig.anthropic.com") == "" {
		t.Fatalf("agent a learn = %+v", a.Learn)
	}
	if a.Approval == nil || a.Approval.Wait != policy.DefaultApprovalWait || a.Approval.MaxPending != policy.DefaultMaxPending {
		t.Fatalf("agent a approval = %+v", a.Approval)
	}
	if b.Learn.For != 10*time.Minute || b.Approval.Wait != 45*time.Second || b.Approval.MaxPending != 2 {
		t.Fatalf("agent b = %+v %+v", b.Learn, b.Approval)
	}
	if c.Learn != nil || c.Approval != nil {
		t.Fatal("learn and approval are off by default")
	}
	j, err := Canonical(cfg)
	if err != nil {
		t.Fatal(err)
	}
	again, diags := NewLoader().Load(Source{Name: "canonical.json", Data: j})
	if diags.HasErrors() {
		t.Fatalf("%v\n%s", diags, j)
	}
	// (Policies differ: canonical JSON declares the default policy.)
	if !reflect.DeepEqual(cfg.Agents, again.Agents) {
		t.Fatalf("round trip changed the model:\n%s", j)
	}
}
