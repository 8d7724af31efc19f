//go:build !amd64 && !arm64

package seal

const (
	nativeArch    = 0
	foreignNrBase = 0
)

// allowList: none for this architecture (Program refuses to build a filter).
var allowList []uint32
