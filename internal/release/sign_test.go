package release

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/rsa"
	"strings"
	"testing"

	"github.com/sigstore/sigstore/pkg/cryptoutils"
)

func genKey(t *testing.T, alg string) (*PrivateKey, *PublicKey) {
	t.Helper()
	priv, pub, err := GenerateKey(alg)
	if err != nil {
		t.Fatal(err)
	}
	sk, err := ParsePrivateKey(priv)
	if err != nil {
		t.Fatal(err)
	}
	pk, err := ParsePublicKey(pub)
	if err != nil {
		t.Fatal(err)
	}
	if sk.ID != pk.ID {
		t.Fatalf("private and public key ids differ: %s %s", sk.ID, pk.ID)
	}
	return sk, pk
}

func TestSignVerifyThreshold(t *testing.T) {
	ed, edPub := genKey(t, AlgEd25519)
	ec, ecPub := genKey(t, AlgECDSAP256)
	other, _ := genKey(t, AlgEd25519)
	msg := []byte(`{"schema":1}`)
	trusted := []*PublicKey{edPub, ecPub}
	cases := []struct {
		name      string
		signers   []*PrivateKey
		threshold int
		tamper    bool
		want      string // "" means accepted
	}{
		{"Ed25519", []*PrivateKey{ed}, 1, false, ""},
		{"ECDSAP256", []*PrivateKey{ec}, 1, false, ""},
		{"TwoOfTwo", []*PrivateKey{ed, ec}, 2, false, ""},
		{"OneOfTwoNeeded", []*PrivateKey{ec}, 2, false, "1 valid signature(s) from trusted keys, threshold is 2"},
		{"UntrustedOnly", []*PrivateKey{other}, 1, false, "signed by untrusted key(s)"},
		{"Tampered", []*PrivateKey{ed}, 1, true, "bad signature"},
		{"Unsigned", nil, 1, false, "release is unsigned"},
		{"ImpossibleThreshold", []*PrivateKey{ed, ec}, 3, false, "no release could ever be accepted"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			sigs, err := Sign(msg, tc.signers)
			if err != nil {
				t.Fatal(err)
			}
			raw, _ := sigs.Marshal()
			sigs, err = ParseSignatures(raw)
			if err != nil {
				t.Fatal(err)
			}
			m := msg
			if tc.tamper {
				m = []byte(`{"schema":2}`)
			}
			err = VerifySignatures(m, sigs, trusted, tc.threshold)
			if tc.want == "" && err != nil {
				t.Fatal(err)
			}
			if tc.want != "" && (err == nil || !strings.Contains(err.Error(), tc.want)) {
				t.Fatalf("error %v, want %q", err, tc.want)
			}
		})
	}
	if _, err := Sign(msg, []*PrivateKey{ed, ed}); err == nil {
		t.Fatal("signing twice with one key should be refused")
	}
}

func TestOnlyEd25519AndP256Accepted(t *testing.T) {
	rk, _ := rsa.GenerateKey(rand.Reader, 2048)
	pk384, _ := ecdsa.GenerateKey(elliptic.P384(), rand.Reader)
	for name, pub := range map[string]any{"rsa": &rk.PublicKey, "p384": &pk384.PublicKey} {
		pem, err := cryptoutils.MarshalPublicKeyToPEM(pub)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := ParsePublicKey(pem); err == nil {
			t.Errorf("%s public key accepted", name)
		}
	}
	if _, _, err := GenerateKey("rsa"); err == nil || !strings.Contains(err.Error(), "use ed25519 or ecdsa-p256") {
		t.Errorf("GenerateKey(rsa): %v", err)
	}
}
