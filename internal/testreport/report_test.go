package testreport

import (
	"bytes"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	"github.com/nixcage/nixcage/internal/testenv"
)

// fixtureJSON runs the real `go test -json` on testdata/fixture, a module
// whose tests cover what a run can bring: tier markers with inheritance, a
// subtest skip, a silent skip, a parent failing after passing subtests, a
// nested failure, a build failure, a TestMain exiting non-zero and a test
// killed by -timeout.
// It runs once per test binary (the timeout costs seconds).
func fixtureJSON(t *testing.T) []byte {
	t.Helper()
	fixture.Do(func() { fixture.out, fixture.err = runFixture(t) })
	if fixture.err != "" {
		t.Fatal(fixture.err)
	}
	return fixture.out
}

var fixture struct {
	sync.Once
	out []byte
	err string
}

func runFixture(t *testing.T) ([]byte, string) {
	goTool := testenv.LookPath(t, "go")
	cmd := exec.Command(goTool, "test", "-json", "-count=1", "-timeout", "3s", "./...")
	cmd.Dir = filepath.Join("testdata", "fixture")
	cmd.Env = append(os.Environ(), "GOFLAGS=", "GOWORK=off")
	out, err := cmd.Output()
	if err == nil {
		return nil, "go test on the fixture passed; it must fail"
	}
	return out, ""
}

func TestResultsFromRealGoTest(t *testing.T) {
	c := NewCollector()
	if err := c.ReadJSON(bytes.NewReader(fixtureJSON(t))); err != nil {
		t.Fatal(err)
	}
	got := map[string]Result{}
	for _, r := range c.Results() {
		got[shortName(r)] = r
	}
	const p = "example.com/fix/"
	want := map[string]Result{
		p + "tiers TestUnit":                   {Tier: "unit", Outcome: Pass},
		p + "tiers TestPrivileged/ok":          {Tier: "privileged", Outcome: Pass},
		p + "tiers TestPrivileged/lacks":       {Tier: "privileged", Outcome: Skip, Reason: "this machine lacks cgroup v2: use a unified host"},
		p + "tiers TestSystemSkipped":          {Tier: "system", Outcome: Skip, Reason: "system test: set NIXCAGE_TEST_SYSTEM=1"},
		p + "tiers TestSystemSkippedToo":       {Tier: "system", Outcome: Skip, Reason: "system test: set NIXCAGE_TEST_SYSTEM=1"},
		p + "tiers TestParentFailsItself":      {Tier: "unit", Outcome: Fail},
		p + "tiers TestParentFailsItself/fine": {Tier: "unit", Outcome: Pass},
		p + "tiers TestSkipThenCleanupLogs":    {Tier: "system", Outcome: Skip, Reason: "podman cannot run here"},
		p + "tiers TestSilentSkip":             {Tier: "unit", Outcome: Skip, Reason: "(no reason printed)"},
		p + "tiers TestNestedFail/a/b":         {Tier: "privileged", Outcome: Fail},
		p + "bad (package)":                    {Tier: "unit", Outcome: Fail, Reason: "build failed"},
		p + "mainfail TestFine":                {Tier: "unit", Outcome: Pass},
		p + "mainfail (package)":               {Tier: "unit", Outcome: Fail, Reason: "package failed with no failing test (TestMain, init or a crash, see its output)"},
		p + "timeout TestHangs":                {Tier: "unit", Outcome: Fail, Reason: "did not finish (test binary crashed or timed out, see the package output)"},
	}
	for name, w := range want {
		g, ok := got[name]
		if !ok {
			t.Errorf("%s: not counted", name)
			continue
		}
		if g.Tier != w.Tier || g.Outcome != w.Outcome || g.Reason != w.Reason {
			t.Errorf("%s = {%s %s %q}, want {%s %s %q}", name, g.Tier, g.Outcome, g.Reason, w.Tier, w.Outcome, w.Reason)
		}
	}
	// Parents with subtests are counted through them, unless they failed
	// on their own.
	for _, parent := range []string{"tiers TestPrivileged", "tiers TestNestedFail", "tiers TestNestedFail/a"} {
		if _, ok := got[p+parent]; ok {
			t.Errorf("%s counted besides its subtests", parent)
		}
	}
	if len(got) != len(want) {
		t.Errorf("counted %d items, want %d: %v", len(got), len(want), got)
	}
}

func TestSummaryAndClosingLine(t *testing.T) {
	c := NewCollector()
	if err := c.ReadJSON(bytes.NewReader(fixtureJSON(t))); err != nil {
		t.Fatal(err)
	}
	steps := "static checks\tgofmt\tpass\nstatic checks\tnix syntax\tskip\tno nix-instantiate\nfuzz\tFuzzLoad\tfail\n"
	if err := c.ReadSteps(strings.NewReader(steps)); err != nil {
		t.Fatal(err)
	}
	s := Summarize(c.Results())
	var out bytes.Buffer
	s.Write(&out)
	text := out.String()
	lines := strings.Split(strings.TrimSpace(text), "\n")
	// 5 passed (gofmt, TestUnit, TestPrivileged/ok, .../fine, TestFine),
	// 6 failed (fuzz, parent, nested, build, TestMain, timeout),
	// 6 skipped (nix syntax, lacks, three system, silent).
	if last := lines[len(lines)-1]; last != "5 passed, 6 failed, 6 skipped" {
		t.Errorf("closing line %q\n%s", last, text)
	}
	for _, want := range []string{
		"static checks       1       1       0        1",
		"system              0       0       0        3",
		"[system] 2× system test: set NIXCAGE_TEST_SYSTEM=1",
		"example.com/fix/tiers TestSystemSkipped, example.com/fix/tiers TestSystemSkippedToo",
		"[privileged] example.com/fix/tiers TestNestedFail/a/b",
		"[fuzz] FuzzLoad",
	} {
		if !strings.Contains(text, want) {
			t.Errorf("summary lacks %q:\n%s", want, text)
		}
	}
}

func TestStreamPrintsFailuresNotMarkers(t *testing.T) {
	var out, rec bytes.Buffer
	in := fixtureJSON(t)
	if err := Stream(bytes.NewReader(in), &out, &rec); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(rec.Bytes(), in) {
		t.Errorf("record differs from the input")
	}
	text := out.String()
	for _, want := range []string{
		"--- FAIL: TestNestedFail/a/b", "deep",
		"--- FAIL: TestParentFailsItself", "after the subtests", "second line",
		"undefined: y",
		"panic: test timed out", // the log of a test that never finished
		"FAIL\texample.com/fix/mainfail",
	} {
		if !strings.Contains(text, want) {
			t.Errorf("stream output lacks %q:\n%s", want, text)
		}
	}
	for _, banned := range []string{testenv.Marker, "=== RUN", "--- SKIP"} {
		if strings.Contains(text, banned) {
			t.Errorf("stream output shows %q:\n%s", banned, text)
		}
	}
}

func TestBadSteps(t *testing.T) {
	for _, in := range []string{"unit\tonly two", "unit\tx\tmaybe"} {
		if err := NewCollector().ReadSteps(strings.NewReader(in)); err == nil {
			t.Errorf("ReadSteps(%q) accepted it", in)
		}
	}
}
