package dnsfilter

import (
	"fmt"
	"math"
	"strings"
	"sync"
	"time"
)

// An agent can still choose which allowed name to ask for, and under an
// allowed wildcard that choice is data ("<base32 chunk>.x.example.com").
// The watcher flags the two shapes that takes: many distinct names under
// one allow pattern in a short window, and long random-looking labels. A
// flag is a record (decision flagged, counted by caged, shown by cagectl),
// not a refusal: CDNs make both shapes too. Per-query flags are DNS
// records like any other (under the audit budget, so they can be counted
// into a summary); the first flag per allow pattern and window is also an
// alert record of its own, outside the budget, so the pattern is always
// named in the log however large the flood around it.
const (
	patternWindow   = time.Minute
	patternDistinct = 64  // distinct names under one pattern per window
	entropyMinLabel = 16  // labels shorter than this are not judged
	entropyBits     = 3.5 // bits per character
)

type watcher struct {
	mu      sync.Mutex
	start   time.Time
	names   map[string]map[string]bool // rule -> names seen this window
	alerted map[string]bool            // rule -> alert written this window
}

func newWatcher() *watcher {
	return &watcher{names: map[string]map[string]bool{}, alerted: map[string]bool{}}
}

// observe notes an allowed lookup of name under rule and returns why it
// looks unusual, or "", and whether this is the first unusual lookup under
// rule in this window (the one that gets an alert record).
func (w *watcher) observe(name, rule string, now time.Time) (string, bool) {
	var why []string
	for _, l := range strings.Split(name, ".") {
		if len(l) >= entropyMinLabel {
			if e := entropy(l); e >= entropyBits {
				why = append(why, fmt.Sprintf("label of %d characters with %.1f bits/character (data in labels?)", len(l), e))
				break
			}
		}
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	if now.Sub(w.start) >= patternWindow {
		w.start = now
		clear(w.names)
		clear(w.alerted)
	}
	set := w.names[rule]
	if set == nil {
		set = map[string]bool{}
		w.names[rule] = set
	}
	if len(set) <= patternDistinct {
		set[name] = true
	}
	if n := len(set); n > patternDistinct {
		why = append(why, fmt.Sprintf("more than %d distinct names under %s within %s (data in names?)", patternDistinct, strings.TrimPrefix(rule, "allow:"), patternWindow))
	}
	if len(why) == 0 {
		return "", false
	}
	first := !w.alerted[rule]
	w.alerted[rule] = true
	return strings.Join(why, "; "), first
}

// entropy is the Shannon entropy of s in bits per character.
func entropy(s string) float64 {
	var counts [256]int
	for i := 0; i < len(s); i++ {
		counts[s[i]]++
	}
	var h float64
	for _, c := range counts {
		if c > 0 {
			p := float64(c) / float64(len(s))
			h -= p * math.Log2(p)
		}
	}
	return h
}
