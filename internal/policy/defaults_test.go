package policy

import (
	"fmt"
	"os"
	"strings"
	"testing"
)

// The docs quote the model's defaults; this holds them to the constants, so
// a changed default cannot leave a second number standing in the docs.
func TestDocsQuoteDefaults(t *testing.T) {
	kib := func(n int) string { return fmt.Sprintf("%d KiB", n>>10) }
	mib := func(n int) string { return fmt.Sprintf("%d MiB", n>>20) }
	want := map[string][]string{
		"../../docs/config.md": {
			fmt.Sprintf("| limits | %d connections and streams (`max_tunnels`), %s headers, %s bodies, %d s idle |", DefaultMaxTunnels, kib(DefaultMaxHeaderBytes), mib(DefaultMaxBodyBytes), DefaultIdleTimeoutSeconds),
			fmt.Sprintf("| rate_limit | %g/s, burst %d, per host |", DefaultRatePerSecond, DefaultRateBurst),
			fmt.Sprintf("entropy flag (%g bits/byte)", DefaultEntropyBits),
			fmt.Sprintf("encoded_blobs flag (%d chars; entropy tokens of %d bytes or more)", DefaultBlobMinLength, DefaultEntropyMinLength),
			fmt.Sprintf("| dns | on; %s answered; %s refused; labels up to %d |", strings.Join(DefaultDNSAllowTypes, ", "), strings.Join(DefaultDNSDenyTypes, ", "), DefaultMaxLabelLength),
			fmt.Sprintf("max_tunnels      = %d\n", DefaultMaxTunnels),
			fmt.Sprintf("max_header_bytes = %d\n", DefaultMaxHeaderBytes),
			fmt.Sprintf("max_body_bytes   = %d\n", DefaultMaxBodyBytes),
		},
		"../../docs/egress.md": {
			fmt.Sprintf("%d\n   connections and streams, %s headers, %s bodies, %d s idle.", DefaultMaxTunnels, kib(DefaultMaxHeaderBytes), mib(DefaultMaxBodyBytes), DefaultIdleTimeoutSeconds),
			fmt.Sprintf("tokens of at least `min_length` (%d) bytes with Shannon entropy at least `threshold` (%g) bits/byte", DefaultEntropyMinLength, DefaultEntropyBits),
			fmt.Sprintf("base64 or hex runs of at least `min_length` (%d) bytes", DefaultBlobMinLength),
		},
	}
	for file, quotes := range want {
		b, err := os.ReadFile(file)
		if err != nil {
			t.Fatal(err)
		}
		for _, q := range quotes {
			if !strings.Contains(string(b), q) {
				t.Errorf("%s does not say %q (the default in internal/policy/defaults.go)", file, q)
			}
		}
	}
}
