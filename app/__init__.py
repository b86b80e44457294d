"""The trustscope dashboard (Streamlit): ``trustscope dashboard [LOGDIR]`` or ``streamlit run app/main.py``."""
