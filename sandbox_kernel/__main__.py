from sandbox_kernel.cli.main import main

raise SystemExit(main())
