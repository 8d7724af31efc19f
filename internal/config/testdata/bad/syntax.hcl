# want: 3:12 Invalid expression
agent "a" {
  backend =
}
