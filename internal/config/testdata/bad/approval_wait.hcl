# want: 5:12 Invalid approval wait
agent "a" {
  command = ["/bin/true"]
  approval {
    wait = "1h"
  }
}
