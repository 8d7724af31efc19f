package testreport

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
)

// ErrFailed is returned by Run when the report counts a failure, so the
// caller's exit status tells the truth.
var ErrFailed = errors.New("tests failed")

const usage = `usage:
  summary stream -record FILE        go test -json on stdin; readable output on stdout, the JSON kept in FILE
  summary report [-steps FILE] [-go-test-status N] JSON...
                                     the per-tier summary; exit status 1 if anything failed`

// Run is the summary command (checks/summary).
func Run(ctx context.Context, args []string, stdin io.Reader, stdout, stderr io.Writer) error {
	if len(args) == 0 {
		return fmt.Errorf("no subcommand\n%s", usage)
	}
	switch args[0] {
	case "stream":
		return runStream(args[1:], stdin, stdout)
	case "report":
		return runReport(args[1:], stdout)
	}
	return fmt.Errorf("unknown subcommand %q\n%s", args[0], usage)
}

func runStream(args []string, stdin io.Reader, stdout io.Writer) error {
	fs := flag.NewFlagSet("stream", flag.ContinueOnError)
	record := fs.String("record", "", "file to keep the JSON events in (required)")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if *record == "" {
		return fmt.Errorf("stream: -record FILE is required\n%s", usage)
	}
	f, err := os.Create(*record)
	if err != nil {
		return fmt.Errorf("stream: %w", err)
	}
	if err := Stream(stdin, stdout, f); err != nil {
		f.Close()
		return fmt.Errorf("stream: %w", err)
	}
	return f.Close()
}

func runReport(args []string, stdout io.Writer) error {
	fs := flag.NewFlagSet("report", flag.ContinueOnError)
	steps := fs.String("steps", "", "steps recorded by checks/test.sh (tier, name, outcome, reason; tab-separated)")
	status := fs.Int("go-test-status", 0, "exit status of the go test run that wrote the JSON: non-zero with no failure in it still fails the report")
	if err := fs.Parse(args); err != nil {
		return err
	}
	c := NewCollector()
	if *steps != "" {
		if err := readFile(*steps, c.ReadSteps); err != nil {
			return fmt.Errorf("report: %w", err)
		}
	}
	for _, p := range fs.Args() {
		if err := readFile(p, c.ReadJSON); err != nil {
			return fmt.Errorf("report: %w", err)
		}
	}
	results := c.Results()
	if *status != 0 && !anyFailed(results) {
		results = append(results, Result{Tier: "unit", Name: "go test", Outcome: Fail,
			Reason: fmt.Sprintf("exited %d but its JSON holds no failure (see its output above)", *status)})
	}
	s := Summarize(results)
	s.Write(stdout)
	if s.Total.Failed > 0 {
		return ErrFailed
	}
	if s.Total.Passed == 0 {
		return errors.New("report: nothing passed: no test ran")
	}
	return nil
}

func anyFailed(rs []Result) bool {
	for _, r := range rs {
		if r.Package != "" && r.Outcome == Fail {
			return true
		}
	}
	return false
}

func readFile(path string, read func(io.Reader) error) error {
	f, err := os.Open(path)
	if err != nil {
		return err
	}
	defer f.Close()
	if err := read(f); err != nil {
		return fmt.Errorf("%s: %w", path, err)
	}
	return nil
}
