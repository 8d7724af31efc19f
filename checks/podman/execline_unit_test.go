package podman

import (
	"reflect"
	"strings"
	"testing"
)

func TestExecArgv(t *testing.T) {
	cases := []struct {
		name string
		line string
		want []string
		err  string
	}{
		{name: "plain words", line: "/bin/echo a  b\tc", want: []string{"/bin/echo", "a", "b", "c"}},
		{name: "double quotes keep blanks", line: `/bin/sh -c "echo hi there"`, want: []string{"/bin/sh", "-c", "echo hi there"}},
		{name: "single quotes kept inside double", line: `/bin/sh -c "exec '/usr/bin/podman' x"`, want: []string{"/bin/sh", "-c", "exec '/usr/bin/podman' x"}},
		{name: "escaped quote inside quotes", line: `/bin/sh -c "b=\"$$b x\""`, want: []string{"/bin/sh", "-c", `b="$b x"`}},
		{name: "dollar dollar", line: `/bin/sh -c "$$@" a`, want: []string{"/bin/sh", "-c", "$@", "a"}},
		{name: "percent percent", line: "/bin/date +%%s", want: []string{"/bin/date", "+%s"}},
		{name: "quotes join with bare text", line: `/bin/x a"b c"d`, want: []string{"/bin/x", "ab cd"}},
		{name: "c escapes", line: `/bin/x \x41\101\t\s`, want: []string{"/bin/x", "AA\t "}},
		{name: "empty quoted word", line: `/bin/x ""`, want: []string{"/bin/x", ""}},
		{name: "lone dollar refused", line: "/bin/x $HOME", err: "environment expansion"},
		{name: "specifier refused", line: "/bin/x %i", err: "specifier"},
		{name: "unterminated quote", line: `/bin/x "a`, err: "unterminated"},
		{name: "prefix refused", line: "-/bin/x", err: "prefix"},
		{name: "empty", line: "   ", err: "empty"},
		{name: "unknown escape", line: `/bin/x \q`, err: "unknown escape"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			got, err := execArgv(tc.line)
			if tc.err != "" {
				if err == nil || !strings.Contains(err.Error(), tc.err) {
					t.Fatalf("execArgv(%q) = %q, %v; want error containing %q", tc.line, got, err, tc.err)
				}
				return
			}
			if err != nil || !reflect.DeepEqual(got, tc.want) {
				t.Fatalf("execArgv(%q) = %q, %v; want %q", tc.line, got, err, tc.want)
			}
		})
	}
}
