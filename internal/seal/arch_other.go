//go:build !amd64 && !arm64

package seal

const (
	nativeArch    = 0
	foreignNrBase = 0
)
