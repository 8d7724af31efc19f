package seal

// legacyAllow: arm64 has none of amd64's older calls.
var legacyAllow []uint32
