# want: 2:11 Unsupported config version
version = 2
