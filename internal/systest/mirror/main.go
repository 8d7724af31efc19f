// Command mirror prints the Debian mirror and apt proxy settings the system
// tests build machine trees with (systest.Mirror, systest.ProxyEnv), for
// scripts such as checks/fresh.sh: the mirror on the first line, then one
// NAME=VALUE proxy variable per line.
package main

import (
	"context"
	"fmt"

	"github.com/nixcage/nixcage/internal/systest"
)

func main() {
	ctx := context.Background()
	fmt.Println(systest.Mirror())
	for _, kv := range systest.ProxyEnv(ctx) {
		fmt.Println(kv)
	}
}
