package control

import (
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/nixcage/nixcage/internal/release"
	"github.com/nixcage/nixcage/internal/release/releasetest"
)

func key(t *testing.T) *release.PrivateKey {
	k, _, _ := releasetest.Key(t, release.AlgEd25519)
	return k
}

var t0 = time.Date(2026, 12, 1, 12, 0, 0, 0, time.UTC)

func cmd(t *testing.T, mut ...func(*Command)) *Command {
	t.Helper()
	n, err := NewNonce()
	if err != nil {
		t.Fatal(err)
	}
	c := &Command{Schema: Schema, Action: ActionQuarantine, Host: "web-01", Agent: "alice", Issued: t0, Expires: t0.Add(time.Hour), Nonce: n, Reason: "exfiltration"}
	for _, m := range mut {
		m(c)
	}
	return c
}

func signed(t *testing.T, c *Command, keys ...*release.PrivateKey) []byte {
	t.Helper()
	s, err := Sign(c, keys)
	if err != nil {
		t.Fatal(err)
	}
	b, err := s.Marshal()
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// Every way a malicious publisher (or a careless one) can get a command
// wrong is refused with its reason and status; only the good one passes.
func TestCheckRefusals(t *testing.T) {
	ops, sec, stranger := key(t), key(t), key(t)
	trusted := []*release.PublicKey{ops.Public(), sec.Public()}
	now := t0.Add(time.Minute)

	good := cmd(t)
	goodRaw := signed(t, good, ops)

	// A valid signature carried over onto different bytes: the attacker
	// keeps ops' signature and changes the target agent.
	var env Signed
	if err := json.Unmarshal(goodRaw, &env); err != nil {
		t.Fatal(err)
	}
	swapped := *good
	swapped.Agent = "bob"
	env.Command = swapped.Canonical()
	transplanted, _ := json.Marshal(env)

	// The same command, reformatted (whitespace, key order, time zone):
	// the canonical bytes are what is signed, so it still verifies.
	var generic map[string]any
	json.Unmarshal(good.Canonical(), &generic)
	generic["issued"] = good.Issued.In(time.FixedZone("X", 3600)).Format(time.RFC3339)
	reordered, _ := json.MarshalIndent(generic, "", "    ")
	reEnv := env
	reEnv.Command = reordered
	reEnv.Signatures = nil
	json.Unmarshal(goodRaw, &struct {
		Signatures *[]release.Signature `json:"signatures"`
	}{&reEnv.Signatures})
	reformatted, _ := json.Marshal(reEnv)

	unknownField := strings.Replace(string(goodRaw), `"schema": 1,`, `"schema": 1, "extra": true,`, 1)

	cases := []struct {
		name      string
		raw       []byte
		threshold int
		status    string
		reason    string
	}{
		{"good", goodRaw, 1, "", ""},
		{"reformatted", reformatted, 1, "", ""},
		{"wrong key", signed(t, cmd(t), stranger), 1, StatusRejected, "not in control.keys"},
		{"below threshold", goodRaw, 2, StatusRejected, "1 valid signature(s) from control keys, threshold is 2"},
		{"threshold met", signed(t, good, ops, sec), 2, "", ""},
		{"same key twice does not count twice", func() []byte {
			var e Signed
			json.Unmarshal(goodRaw, &e)
			e.Signatures = append(e.Signatures, e.Signatures[0])
			b, _ := json.Marshal(e)
			return b
		}(), 2, StatusRejected, "threshold is 2"},
		{"signature over other bytes", transplanted, 1, StatusRejected, "does not match the command"},
		{"unsigned", func() []byte {
			b, _ := json.Marshal(Signed{Schema: Schema, Command: good.Canonical()})
			return b
		}(), 1, StatusRejected, "unsigned"},
		{"expired", signed(t, cmd(t, func(c *Command) { c.Issued, c.Expires = t0.Add(-2*time.Hour), t0.Add(-time.Hour) }), ops), 1, StatusExpired, "expired at"},
		{"expired within skew is valid", signed(t, cmd(t, func(c *Command) { c.Issued, c.Expires = t0.Add(-time.Hour), now.Add(-ClockSkew+time.Second) }), ops), 1, "", ""},
		{"not yet valid", signed(t, cmd(t, func(c *Command) { c.Issued, c.Expires = now.Add(ClockSkew+time.Minute), now.Add(2*time.Hour) }), ops), 1, StatusRejected, "not yet valid"},
		{"issued within skew is valid", signed(t, cmd(t, func(c *Command) { c.Issued, c.Expires = now.Add(ClockSkew-time.Second), now.Add(time.Hour) }), ops), 1, "", ""},
		{"lifetime too long", signed(t, cmd(t, func(c *Command) { c.Expires = c.Issued.Add(MaxLifetime + time.Second) }), ops), 1, StatusRejected, "more than the 24h0m0s allowed"},
		{"wrong host", signed(t, cmd(t, func(c *Command) { c.Host = "db-02" }), ops), 1, StatusRejected, "wrong host"},
		{"every host", signed(t, cmd(t, func(c *Command) { c.Host = All }), ops), 1, "", ""},
		{"unknown action", signed(t, cmd(t, func(c *Command) { c.Action = "format-disk" }), ops), 1, StatusRejected, "unknown action"},
		{"ban without a name", signed(t, cmd(t, func(c *Command) { c.Action = ActionBanHost }), ops), 1, StatusRejected, "needs the host name"},
		{"ban of an IP", signed(t, cmd(t, func(c *Command) { c.Action, c.Ban = ActionBanHost, "10.0.0.1" }), ops), 1, StatusRejected, "is not a host name"},
		{"ban name on a kill", signed(t, cmd(t, func(c *Command) { c.Action, c.Ban = ActionKill, "evil.example.com" }), ops), 1, StatusRejected, "takes no"},
		{"bad nonce", signed(t, cmd(t, func(c *Command) { c.Nonce = "1" }), ops), 1, StatusRejected, "nonce"},
		{"multi-line reason", signed(t, cmd(t, func(c *Command) { c.Reason = "a\nb" }), ops), 1, StatusRejected, "one line"},
		{"bad agent name", signed(t, cmd(t, func(c *Command) { c.Agent = "../etc" }), ops), 1, StatusRejected, "not an agent name"},
		{"malformed JSON", []byte(`{"schema":1,"command":`), 1, StatusRejected, "malformed"},
		{"unknown envelope field", []byte(unknownField), 1, StatusRejected, "malformed"},
		{"trailing data", append(append([]byte{}, goodRaw...), []byte(`{}`)...), 1, StatusRejected, "trailing data"},
		{"no command", []byte(`{"schema":1,"signatures":[]}`), 1, StatusRejected, "no command"},
		// Valid RFC 3339, but year 10000 (and -1) in UTC: no canonical
		// bytes exist, so the document is malformed, not a panic.
		{"time past year 9999 in UTC", []byte(`{"schema":1,"command":{"schema":1,"action":"kill","host":"*","agent":"*","issued":"9999-12-31T23:00:00-23:59","expires":"9999-12-31T23:59:59-23:59","nonce":"00000000000000000000000000000000","reason":"x"},"signatures":[]}`), 1, StatusRejected, "outside the years 0-9999"},
		{"time before year 0 in UTC", []byte(`{"schema":1,"command":{"schema":1,"action":"kill","host":"*","agent":"*","issued":"0000-01-01T00:00:00+23:59","expires":"0000-01-01T01:00:00+23:59","nonce":"00000000000000000000000000000000","reason":"x"},"signatures":[]}`), 1, StatusRejected, "outside the years 0-9999"},
		{"oversized", make([]byte, MaxSize+1), 1, StatusRejected, "more than the"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			_, err := Check(tc.raw, trusted, tc.threshold, "web-01", now)
			if tc.status == "" {
				if err != nil {
					t.Fatalf("refused: %v", err)
				}
				return
			}
			if err == nil {
				t.Fatalf("accepted, want %s (%s)", tc.status, tc.reason)
			}
			r := AsRefusal(err)
			if r.Status != tc.status || !strings.Contains(r.Reason, tc.reason) {
				t.Fatalf("refusal %s %q, want %s containing %q", r.Status, r.Reason, tc.status, tc.reason)
			}
		})
	}
}

// The hash is over the canonical bytes: the same for a reformatted
// document, different for any changed field.
func TestCanonicalHash(t *testing.T) {
	c := cmd(t)
	same := *c
	same.Issued = c.Issued.In(time.FixedZone("X", -7200))
	if c.Hash() != same.Hash() {
		t.Error("the same instant in another zone hashes differently")
	}
	other := *c
	other.Reason = "other"
	if c.Hash() == other.Hash() {
		t.Error("a changed reason hashes the same")
	}
	if !strings.HasPrefix(string(c.Canonical()), `{"schema":1,"action":"quarantine","host":"web-01","agent":"alice","issued":"2026-12-01T12:00:00Z"`) {
		t.Errorf("canonical bytes %s", c.Canonical())
	}
}

// Co-signing adds signatures over the same bytes; a key signs once.
func TestCosign(t *testing.T) {
	a, b := key(t), key(t)
	c := cmd(t)
	s, err := Sign(c, []*release.PrivateKey{a})
	if err != nil {
		t.Fatal(err)
	}
	if err := s.AddSignatures([]*release.PrivateKey{b}); err != nil {
		t.Fatal(err)
	}
	if err := s.AddSignatures([]*release.PrivateKey{a}); err == nil {
		t.Error("a key signed twice")
	}
	raw, _ := s.Marshal()
	if _, err := Check(raw, []*release.PublicKey{a.Public(), b.Public()}, 2, "web-01", t0); err != nil {
		t.Fatal(err)
	}
}

// The replay cache: a claim survives reopening (a caged restart), a
// replay by hash or nonce is a duplicate, expired entries leave, and a
// corrupt file refuses every claim rather than forgetting.
func TestReplayCache(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "control", "replay.json")
	c, err := OpenCache(path)
	if err != nil {
		t.Fatal(err)
	}
	exp := t0.Add(time.Hour)
	if err := c.Claim("h1", "n1", exp, t0); err != nil {
		t.Fatal(err)
	}
	c2, _ := OpenCache(path) // a new caged
	for _, tc := range []struct{ hash, nonce string }{{"h1", "n2"}, {"h2", "n1"}} {
		err := c2.Claim(tc.hash, tc.nonce, exp, t0.Add(time.Minute))
		if r := AsRefusal(err); err == nil || r.Status != StatusDuplicate {
			t.Errorf("replay %v: %v", tc, err)
		}
	}
	// After expiry (and the skew), the entry is dropped on the next claim.
	later := exp.Add(ClockSkew + time.Second)
	if err := c2.Claim("h3", "n3", later.Add(time.Hour), later); err != nil {
		t.Fatal(err)
	}
	es, _ := c2.Entries(later)
	if len(es) != 1 || es[0].SHA256 != "h3" {
		t.Errorf("entries after expiry: %+v", es)
	}
	if st, _ := os.Stat(path); st.Mode().Perm() != 0o600 {
		t.Errorf("cache mode %v", st.Mode())
	}
	os.WriteFile(path, []byte("{garbage"), 0o600)
	if err := c2.Claim("h4", "n4", later.Add(time.Hour), later); err == nil || !strings.Contains(err.Error(), "unreadable") {
		t.Errorf("corrupt cache: %v", err)
	}
}

// Acks append, rotate at MaxAckLog and read back newest-last.
func TestAckLogRotates(t *testing.T) {
	l, err := OpenAckLog(filepath.Join(t.TempDir(), "acks.jsonl"))
	if err != nil {
		t.Fatal(err)
	}
	reason := strings.Repeat("x", 1000)
	n := MaxAckLog/1000 + 50
	for i := 0; i < n; i++ {
		if err := l.Append(Ack{Schema: Schema, Status: StatusRejected, Reason: reason, SHA256: HashBytes([]byte{byte(i)})}); err != nil {
			t.Fatal(err)
		}
	}
	st, _ := os.Stat(l.path)
	if st.Size() >= MaxAckLog {
		t.Errorf("ack file %d bytes, not rotated", st.Size())
	}
	all, _ := l.Read(0)
	last, _ := l.Read(3)
	if len(all) < 50 || len(all) >= n+1 || len(last) != 3 || last[2].SHA256 != HashBytes([]byte{byte(n - 1)}) {
		t.Errorf("read %d acks, last %+v", len(all), last)
	}
}
