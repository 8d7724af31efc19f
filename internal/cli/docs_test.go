package cli

import (
	"bufio"
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// Every `cagectl ...` line in a fenced block of README.md and docs/*.md
// names a command that exists and only flags that command takes, so the
// docs cannot drift from the CLI. (The blocks a reader runs as a whole are
// run verbatim on a booted systemd: checks/system TestInstallAsDocumented.)
func TestDocumentedCommandLinesParse(t *testing.T) {
	docs, _ := filepath.Glob("../../docs/*.md")
	docs = append(docs, "../../README.md")
	seen := 0
	for _, doc := range docs {
		f, err := os.Open(doc)
		if err != nil {
			t.Fatal(err)
		}
		sc := bufio.NewScanner(f)
		in, n := false, 0
		for sc.Scan() {
			n++
			line := strings.TrimSpace(sc.Text())
			if strings.HasPrefix(line, "```") {
				in = !in
				continue
			}
			if !in {
				continue
			}
			for _, cmd := range commandLines(line) {
				seen++
				if msg := checkCommandLine(cmd); msg != "" {
					t.Errorf("%s:%d: %s\n\t%s", doc, n, msg, cmd)
				}
			}
		}
		f.Close()
	}
	// The checker itself: a stale flag and a missing command are caught.
	for _, bad := range []string{"cagectl rollback --jobs 3", "cagectl frobnicate x", "cagectl store gc --channel x"} {
		if checkCommandLine(bad) == "" {
			t.Errorf("checkCommandLine passed %q", bad)
		}
	}
	if seen < 20 {
		t.Errorf("only %d documented cagectl lines found; is the extraction broken?", seen)
	}
}

// commandLines returns the cagectl invocations on a shell line: after
// "$ ", "&&", ";", "|", "$(" or "<(", with the comment dropped.
func commandLines(line string) []string {
	line = strings.TrimPrefix(line, "$ ")
	if i := strings.Index(line, " #"); i >= 0 {
		line = line[:i]
	}
	var out []string
	for {
		i := strings.Index(line, "cagectl ")
		if i < 0 {
			return out
		}
		before := strings.TrimSpace(line[:i])
		line = line[i:]
		end := len(line)
		for _, sep := range []string{" && ", " || ", "; ", " | ", ")", " > ", " < "} {
			if j := strings.Index(line, sep); j >= 0 && j < end {
				end = j
			}
		}
		if before == "" || strings.HasSuffix(before, "&&") || strings.HasSuffix(before, ";") || strings.HasSuffix(before, "|") ||
			strings.HasSuffix(before, "$(") || strings.HasSuffix(before, "<(") || strings.HasSuffix(before, "sudo") || strings.HasSuffix(before, "--clear-groups") {
			out = append(out, strings.TrimSpace(line[:end]))
		}
		line = line[end:]
	}
}

// checkCommandLine says what is wrong with one documented invocation.
func checkCommandLine(line string) string {
	words := strings.Fields(line)[1:]
	if len(words) == 0 || strings.HasPrefix(words[0], "-") || strings.ToUpper(words[0]) == words[0] {
		return "" // flags of cagectl itself, or a placeholder such as COMMAND
	}
	// "start|stop|restart AGENT...": each alternative is a command.
	for _, alt := range strings.Split(words[0], "|") {
		ws := append([]string{alt}, words[1:]...)
		c, rest := lookup(ws)
		if c == nil {
			if len(subcommands(alt)) > 0 && (len(ws) == 1 || wantsHelp(ws[1:])) {
				continue
			}
			return "no command " + alt
		}
		flags := map[string]bool{"help": true, "h": true}
		for _, f := range flagsOf(context.Background(), c) {
			flags[f.Name] = true
		}
		for _, w := range rest {
			if w == "--" {
				break
			}
			if !strings.HasPrefix(w, "-") || w == "-" || strings.HasPrefix(w, "-$") {
				continue
			}
			name := strings.TrimLeft(w, "-")
			name, _, _ = strings.Cut(name, "=")
			name = strings.Trim(name, "[]")
			if name == "" || strings.ContainsAny(name, "|.") {
				continue // a synopsis like [--follow|--json] or a placeholder
			}
			if !flags[name] {
				return "cagectl " + c.name + " has no flag --" + name
			}
		}
	}
	return ""
}
