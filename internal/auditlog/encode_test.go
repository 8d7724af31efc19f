package auditlog

import (
	"bytes"
	"encoding/json"
	"math/rand/v2"
	"reflect"
	"testing"
)

// hardStrings are the strings encoding/json escapes in some special way.
var hardStrings = []string{
	"", "plain", `quote " and \ backslash`, "<script>&amp;</script>",
	"ctl \x00\x01\x07\b\f\n\r\t\x1f\x7f end", "\u2028line\u2029para",
	"bad utf8 \xff\xfe \xc3 end", "é 日本 🙂", "\xed\xa0\x80 surrogate",
	"trailing \xe2\x80", "\u00a0nbsp", "ends in \\",
}

func randString(rng *rand.Rand) string {
	if rng.IntN(2) == 0 {
		return hardStrings[rng.IntN(len(hardStrings))]
	}
	b := make([]byte, rng.IntN(40))
	for i := range b {
		b[i] = byte(rng.IntN(256))
	}
	return string(b)
}

// fill sets every field of r by reflection, so a field added to Record
// is set here whether or not AppendJSON knows it.
func fill(rng *rand.Rand, r *Record) {
	v := reflect.ValueOf(r).Elem()
	for i := 0; i < v.NumField(); i++ {
		f := v.Field(i)
		switch f.Kind() {
		case reflect.String:
			f.SetString(randString(rng))
		case reflect.Int, reflect.Int64:
			switch rng.IntN(4) {
			case 0:
				f.SetInt(0)
			case 1:
				f.SetInt(-rng.Int64())
			default:
				f.SetInt(rng.Int64())
			}
		case reflect.Slice:
			switch rng.IntN(4) {
			case 0: // nil: null
			case 1:
				f.Set(reflect.ValueOf([]string{}))
			default:
				l := make([]string, rng.IntN(4)+1)
				for j := range l {
					l[j] = randString(rng)
				}
				f.Set(reflect.ValueOf(l))
			}
		default:
			panic("fill: field " + v.Type().Field(i).Name + " of kind " + f.Kind().String() + " is new: teach fill and AppendJSON about it")
		}
	}
}

// TestAppendJSONIsMarshal: the gateway's hand-written encoder writes what
// json.Marshal writes, for every field and every kind of string.
func TestAppendJSONIsMarshal(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	for i := 0; i < 20000; i++ {
		var r Record
		fill(rng, &r)
		want, err := json.Marshal(r)
		if err != nil {
			t.Fatal(err)
		}
		if got := r.AppendJSON(nil); !bytes.Equal(got, want) {
			t.Fatalf("record %d:\nAppendJSON %s\nMarshal    %s", i, got, want)
		}
	}
	for _, s := range hardStrings {
		r := Record{Reason: s, Inspectors: []string{s}}
		want, _ := json.Marshal(r)
		if got := r.AppendJSON(nil); !bytes.Equal(got, want) {
			t.Fatalf("%q:\nAppendJSON %s\nMarshal    %s", s, got, want)
		}
	}
}

func FuzzAppendJSON(f *testing.F) {
	for _, s := range hardStrings {
		f.Add(s, int64(0))
	}
	f.Fuzz(func(t *testing.T, s string, n int64) {
		r := Record{Host: s, Path: s, Count: n, BytesIn: n, SecretsInjected: []string{s, s}}
		want, _ := json.Marshal(r)
		if got := r.AppendJSON(nil); !bytes.Equal(got, want) {
			t.Fatalf("%q:\nAppendJSON %s\nMarshal    %s", s, got, want)
		}
	})
}
