"""`python -m sandbox_kernel.kernel -f CONNECTION_FILE`: what the kernelspec starts."""
import sys

if __name__ == "__main__":
    # Begin making the sandbox now, while ipykernel is imported (about as long); the
    # kernel takes it over at boot.
    from sandbox_kernel.sandbox import early_start

    early_start.begin(sys.argv[1:])

    from sandbox_kernel.kernel.app import main

    main()
